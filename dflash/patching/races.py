"""Two-thread checks that show each thread-safety bug class (A-H) of torch.compile and FX.

Each check warms the torch modules it needs on the calling thread (the very first
compile racing on imports is out of scope), then runs one "aggressor" loop and one
"victim" loop on two threads released together by a barrier, for a set number of
seconds, on CPU tensors. Every checked operation counts as a call; every exception,
wrong result, eager fallback of a compiled function or leaked flag counts as a
failure. The classes, their symptoms and the torch versions that have them are
described in ``../shared/torch_races.md`` and ``../shared/packaging_notes.md``;
upstream references: pytorch issue 118260 (umbrella), issue 126024 (A), PR 168999
(FX flag thread-local in 2.14), PR 187589 (D), PR 196637 (G).

Checks are meant to run in a fresh interpreter (``run_check_subprocess``): on plain
torch a check may leave torch's process-global flags set, which would poison any
later compile in the same process.

Command line (what ``run_check_subprocess`` runs)::

    python -m dflash.patching.races B --seconds 1 --json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

BUG_CLASSES: dict[str, str] = {
    "A": "a warm compiled function called in one thread while another thread compiles new functions "
    "raises 'Detected that you are using FX to symbolically trace a dynamo-optimized function' "
    "or silently runs eagerly",
    "B": "a warm compiled function called in one thread while another thread runs "
    "torch.fx.symbolic_trace fails the same way as A",
    "C": "process-global compile/export session flags: torch.compiler.is_compiling() is True in an "
    "eager thread while another compiles; torch.compile() hands back the uncompiled function and "
    "is_exporting() is True while another thread is inside torch.export",
    "D": "FX's process-wide nn.Module patching: another thread's eager module enters the tracer "
    "(NameError 'module is not installed as a submodule'); concurrent make_fx traces "
    "(AssertionError 'CURRENT_PATCHER is None in finally block')",
    "E": "dynamo config.patch(...) in one thread is visible to, and undone by, another thread",
    "F": "a plain torch._dynamo.config assignment on one thread is invisible to worker threads "
    "(a raised recompile_limit is ignored there, which then fall back to eager)",
    "G": "torch._dynamo.error_on_graph_break(True) entered in one thread makes graph breaks "
    "in another thread's compiles raise",
    "H": "eager flex_attention (its _set_compilation_env saves and restores the FX tracing flag) "
    "in one thread races with FX traces in another",
}

# Why a join can take long: a compile in flight when the time is up must finish.
_JOIN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: ``failures`` out of ``calls`` checked operations.

    ``example_error`` is the text of the first failure seen (exception type and
    message, or what went wrong), ``None`` when nothing failed; ``failure_kinds``
    counts failures by the first line of their text (at most 100 characters).
    """

    calls: int
    failures: int
    example_error: str | None = None
    failure_kinds: dict[str, int] = dataclasses.field(default_factory=dict)


class _Tally:
    """Counts checked operations and failures from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.example: str | None = None
        self.kinds: collections.Counter[str] = collections.Counter()

    def ok(self) -> None:
        with self._lock:
            self.calls += 1

    def fail(self, what: str) -> None:
        with self._lock:
            self.calls += 1
            self.failures += 1
            self.kinds[what.splitlines()[0][:100]] += 1
            if self.example is None:
                self.example = what

    def check(self, step: Callable[[], str | None]) -> None:
        """Run ``step``; it returns a failure description, or None when all was right."""
        try:
            problem = step()
        except Exception as exc:  # every exception is a symptom here
            problem = f"{type(exc).__name__}: {exc}".strip()[:500]
        if problem is None:
            self.ok()
        else:
            self.fail(problem)

    def result(self) -> CheckResult:
        return CheckResult(self.calls, self.failures, self.example, dict(self.kinds))


def _race(tally: _Tally, seconds: float, *loops: Callable[[], str | None]) -> None:
    """Run each ``loops`` step repeatedly on its own thread, all released together, for ``seconds``."""
    stop = threading.Event()
    barrier = threading.Barrier(len(loops))

    def run(step: Callable[[], str | None]) -> None:
        barrier.wait()
        while not stop.is_set():
            tally.check(step)

    threads = [threading.Thread(target=run, args=(step,), daemon=True) for step in loops]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(_JOIN_TIMEOUT_S)
        if thread.is_alive():
            tally.fail(f"a racing thread did not finish within {_JOIN_TIMEOUT_S:.0f} s of the stop")


def _check_flags_clean(tally: _Tally) -> None:
    """After a race no thread is tracing, compiling or exporting: every global flag must read False."""
    import torch

    leaked = [
        name
        for name, value in (
            ("torch.fx._symbolic_trace.is_fx_symbolic_tracing()", torch.fx._symbolic_trace.is_fx_symbolic_tracing()),
            ("torch.compiler.is_compiling()", torch.compiler.is_compiling()),
            ("torch.compiler.is_exporting()", torch.compiler.is_exporting()),
        )
        if value
    ]
    if leaked:
        tally.fail("left set after all threads finished: " + ", ".join(leaked))
    else:
        tally.ok()


# --- workloads shared by the checks (and by stress/) -------------------------------------------------------------

_graph_runs = threading.local()


def _counting_backend(gm, example_inputs):
    """A dynamo backend whose graphs count their runs per thread, so an eager fallback shows."""

    def run(*args):
        _graph_runs.count = getattr(_graph_runs, "count", 0) + 1
        return gm.forward(*args)

    return run


def _compiled_call(fn: Callable, *args) -> tuple[object, bool]:
    """Call a function compiled with ``_counting_backend``; returns (output, whether a graph ran)."""
    before = getattr(_graph_runs, "count", 0)
    out = fn(*args)
    return out, getattr(_graph_runs, "count", 0) > before


def sin_plus_one(x):
    """The compiled workload: ``sin(x) + 1``, any shape and floating dtype."""
    import torch

    return torch.sin(x) + 1


def sin_with_graph_break(x):
    """``sin(x) + 1`` with a ``torch._dynamo.graph_break()`` between the two ops."""
    import torch

    y = torch.sin(x)
    torch._dynamo.graph_break()
    return y + 1


def fresh_function(template: Callable, index: int) -> Callable:
    """A copy of ``template`` with its own code object, so dynamo compiles it anew (its cache is per code)."""
    code = template.__code__.replace(co_name=f"{template.__name__}_{index}")
    fresh = types.FunctionType(code, template.__globals__, code.co_name, template.__defaults__, template.__closure__)
    fresh.__kwdefaults__ = template.__kwdefaults__
    return fresh


def traced_net():
    """A small module with one submodule, the target of the FX traces below."""
    import torch

    class TracedNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    return TracedNet()


def _symbolic_trace_step(net) -> Callable[[], str | None]:
    """One torch.fx.symbolic_trace of ``net``; a failure if any module but ``net.lin`` was captured."""
    import torch

    def step() -> str | None:
        gm = torch.fx.symbolic_trace(net)
        called = [node.target for node in gm.graph.nodes if node.op == "call_module"]
        return None if called == ["lin"] else f"symbolic_trace captured call_module targets {called}, expected ['lin']"

    return step


def _warm_compiled_call_step(warm: Callable, x) -> Callable[[], str | None]:
    """Call the warm compiled ``warm``; a failure if it raised, ran eagerly or computed a wrong value."""
    import torch

    expected = sin_plus_one(x)

    def step() -> str | None:
        out, ran_graph = _compiled_call(warm, x)
        if not ran_graph:
            return "warm compiled function ran eagerly (its compiled graph did not run)"
        return None if torch.equal(out, expected) else "warm compiled function returned a wrong value"

    return step


def _compile_new_functions_step(backend: str) -> Callable[[], str | None]:
    """Compile and call a fresh function each step (AOT backends trace with make_fx, i.e. FX)."""
    import torch

    counter = iter(range(1 << 62))
    x = torch.randn(8)

    def step() -> str | None:
        fn = torch.compile(fresh_function(sin_plus_one, next(counter)), backend=backend)
        return None if torch.allclose(fn(x), sin_plus_one(x)) else "fresh compiled function returned a wrong value"

    return step


def _warm_compiled_function():
    import torch

    warm = torch.compile(sin_plus_one, backend=_counting_backend)
    x = torch.randn(8)
    _, ran_graph = _compiled_call(warm, x)
    if not ran_graph:
        raise RuntimeError("warm-up: the compiled function did not run its graph before any race started")
    return warm, x


# --- one check per class ------------------------------------------------------------------------


def _check_a(tally: _Tally, seconds: float) -> None:
    warm, x = _warm_compiled_function()
    compile_new = _compile_new_functions_step("aot_eager")
    compile_new()
    _race(tally, seconds, compile_new, _warm_compiled_call_step(warm, x))


def _check_b(tally: _Tally, seconds: float) -> None:
    warm, x = _warm_compiled_function()
    trace = _symbolic_trace_step(traced_net())
    trace()
    _race(tally, seconds, trace, _warm_compiled_call_step(warm, x))


def _poll_session_flags_step(check_compile_handoff: bool) -> Callable[[], str | None]:
    """Poll the session flags from an eager thread; optionally check torch.compile wraps a function."""
    import torch

    def plain(x):
        return x + 1

    def step() -> str | None:
        # Most specific symptom first: export also sets is_compiling.
        if check_compile_handoff and torch.compile(plain, backend="eager") is plain:
            return "torch.compile() handed back the uncompiled function (another thread is exporting)"
        if torch.compiler.is_exporting():
            return "torch.compiler.is_exporting() is True in an eager thread"
        if torch.compiler.is_compiling():
            return "torch.compiler.is_compiling() is True in an eager thread"
        return None

    return step


def _check_c(tally: _Tally, seconds: float) -> None:
    import warnings

    import torch

    compile_new = _compile_new_functions_step("eager")
    compile_new()
    _race(tally, seconds / 2, compile_new, _poll_session_flags_step(check_compile_handoff=False))

    class Exported(torch.nn.Module):
        def forward(self, x):
            return torch.sin(x) + 1

    args = (torch.randn(8),)

    def export() -> str | None:
        torch.export.export(Exported(), args)
        return None

    export()
    with warnings.catch_warnings():
        # "torch.compile is ignored when called inside torch.export region" is the symptom, counted.
        warnings.simplefilter("ignore")
        _race(tally, seconds / 2, export, _poll_session_flags_step(check_compile_handoff=True))


def _check_d(tally: _Tally, seconds: float) -> None:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    trace = _symbolic_trace_step(traced_net())
    eager = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = eager(x)

    def eager_call() -> str | None:
        with torch.no_grad():
            out = eager(x)
        if not isinstance(out, torch.Tensor):
            return f"an eager nn.Module call returned {type(out).__name__} (captured by another thread's trace)"
        return None if torch.equal(out, expected) else "an eager nn.Module call returned a wrong value"

    trace()
    _race(tally, seconds / 2, trace, eager_call)

    def make_fx_step() -> str | None:
        gm = make_fx(sin_plus_one)(x)
        targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return None if len(targets) == 2 else f"make_fx traced {targets}, expected sin and add"

    make_fx_step()
    _race(tally, seconds / 2, make_fx_step, make_fx_step)


def _recompile_limit_name() -> str:
    import torch

    # recompile_limit replaced cache_size_limit (kept as an alias) in torch 2.7.
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def _check_e(tally: _Tally, seconds: float) -> None:
    import torch

    config = torch._dynamo.config
    name = _recompile_limit_name()
    base = getattr(config, name)

    def patch_step(own: int) -> Callable[[], str | None]:
        def step() -> str | None:
            outside = getattr(config, name)
            if outside != base:
                return f"config.{name} read {outside} outside any patch of this thread (another thread's patch)"
            with config.patch(**{name: own}):
                for _ in range(20):
                    inside = getattr(config, name)
                    if inside != own:
                        return f"config.{name} read {inside} inside this thread's patch to {own}"
            return None

        return step

    _race(tally, seconds, patch_step(base + 1000), patch_step(base + 2000))


def _check_f(tally: _Tally, seconds: float) -> None:
    import torch

    config = torch._dynamo.config
    name = _recompile_limit_name()
    base = getattr(config, name)
    raised = base + 8
    # Shapes beyond the default limit: with the raised limit every call must still run a graph.
    shapes = range(1, base + 4)

    def worker() -> None:
        deadline = time.monotonic() + seconds
        fn = torch.compile(fresh_function(sin_plus_one, 0), backend=_counting_backend, dynamic=False)
        for n in shapes:
            x = torch.randn(n)
            value = getattr(config, name)
            if value != raised:
                tally.fail(f"worker thread reads config.{name} = {value}; the main thread assigned {raised}")
            else:
                tally.ok()
            out, ran_graph = _compiled_call(fn, x)
            if not ran_graph:
                tally.fail(f"compiled function fell back to eager on recompile {n} (limit {raised} assigned)")
            elif not torch.allclose(out, sin_plus_one(x)):
                tally.fail("compiled function returned a wrong value")
            else:
                tally.ok()
            if time.monotonic() > deadline:
                break

    _warm_compiled_function()
    setattr(config, name, raised)
    try:
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        thread.join(seconds + _JOIN_TIMEOUT_S)
        if thread.is_alive():
            tally.fail("the worker thread did not finish")
    finally:
        setattr(config, name, base)


def _check_g(tally: _Tally, seconds: float) -> None:
    import torch

    counter = iter(range(1 << 62))
    x = torch.randn(8)
    expected = sin_plus_one(x)

    def hold_error_on_graph_break() -> None:
        with torch._dynamo.error_on_graph_break(True):
            time.sleep(0.002)  # holds the region open while the other thread compiles

    def compile_with_graph_break() -> str | None:
        # Default error_on_graph_break is False: a graph break must split the graph, not raise.
        fn = torch.compile(fresh_function(sin_with_graph_break, next(counter)), backend="eager")
        return None if torch.allclose(fn(x), expected) else "compiled function returned a wrong value"

    compile_with_graph_break()
    hold_error_on_graph_break()
    _race(tally, seconds, hold_error_on_graph_break, compile_with_graph_break)


def _check_h(tally: _Tally, seconds: float) -> None:
    import warnings

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    block_mask = create_block_mask(causal, 1, 1, 128, 128, device="cpu")
    with warnings.catch_warnings():
        # flex_attention warns once that the eager path is unfused; eager is what is checked here.
        warnings.simplefilter("ignore")
        expected = flex_attention(q, k, v, block_mask=block_mask)

    def eager_flex() -> str | None:
        out = flex_attention(q, k, v, block_mask=block_mask)
        return None if torch.allclose(out, expected, atol=1e-5) else "eager flex_attention returned a wrong value"

    trace = _symbolic_trace_step(traced_net())
    trace()
    _race(tally, seconds, trace, eager_flex)


_CHECKS: dict[str, Callable[[_Tally, float], None]] = {
    "A": _check_a,
    "B": _check_b,
    "C": _check_c,
    "D": _check_d,
    "E": _check_e,
    "F": _check_f,
    "G": _check_g,
    "H": _check_h,
}


def _require_class(bug_class: str) -> None:
    if bug_class not in BUG_CLASSES:
        raise ValueError(f"unknown bug class {bug_class!r}: choose one of {', '.join(BUG_CLASSES)}")


def run_check(bug_class: str, *, seconds: float) -> CheckResult:
    """Run the two-thread check for ``bug_class`` in this interpreter for about ``seconds`` (wall clock).

    Returns the number of checked operations and of failures, with the first failure's
    text. Raises ``ValueError`` for an unknown class or a non-positive duration. On plain
    torch the check may leave torch's global flags set: prefer ``run_check_subprocess``.
    """
    _require_class(bug_class)
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    tally = _Tally()
    _CHECKS[bug_class](tally, seconds)
    _check_flags_clean(tally)
    return tally.result()


def run_check_subprocess(bug_class: str, *, patched: bool, seconds: float) -> CheckResult:
    """Run ``run_check(bug_class, seconds=seconds)`` in a fresh interpreter.

    ``patched`` sets ``DFLASH_PATCHES=1`` (the dflash patch series applied at import) or
    ``0`` (plain torch) in the child's environment. Raises ``RuntimeError`` with the
    child's output when it crashes or prints no result.
    """
    _require_class(bug_class)
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    cmd = [sys.executable, "-m", "dflash.patching.races", bug_class, "--seconds", str(seconds), "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 3 * _JOIN_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
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
        _require_class(bug_class)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        futures = {run: pool.submit(run_check_subprocess, run[0], patched=run[1], seconds=seconds) for run in runs}
        return {run: future.result() for run, future in futures.items()}


def _minor_version(torch_version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", str(torch_version))
    if match is None:
        raise ValueError(f"cannot read a torch version from {torch_version!r}; expected e.g. '2.13.0+cpu'")
    return int(match.group(1)), int(match.group(2))


def applies_to(bug_class: str, torch_version: str) -> bool | str:
    """Whether ``torch_version`` (e.g. ``torch.__version__``) shows ``bug_class`` on plain torch.

    Returns ``True`` when the bug is present and its check must fail on plain torch;
    otherwise a string saying why it is absent or not observable (never ``False``: test
    the result with ``is True``). Source: the version tables of ``shared/torch_races.md``
    and ``shared/packaging_notes.md`` (measured on 2.5.1-2.15.0).
    """
    _require_class(bug_class)
    version = _minor_version(torch_version)
    fx_flag_thread_local = "FX tracing flag is thread-local since torch 2.14 (pytorch PR 168999)"
    if bug_class == "A":
        if version >= (2, 14):
            return fx_flag_thread_local
        if version == (2, 13):
            return (
                "masked by class C on torch 2.13: is_fx_symbolic_tracing() is 'flag and not is_compiling()' "
                "and a compile in flight holds the global is_compiling flag True"
            )
        return True
    if bug_class == "B":
        return True if version < (2, 14) else fx_flag_thread_local
    if bug_class == "E":
        return True if version <= (2, 11) else "dynamo config patches are per-thread since torch 2.12"
    if bug_class == "F":
        return True if version >= (2, 12) else "dynamo config is process-global before torch 2.12 (class E instead)"
    # C (export half on every version measured), D, G: present in 2.5.1 through 2.15.0. H too: 2.14
    # made its FX-flag half thread-local, but eager flex still runs its mask/score GraphModules
    # through FX's process-wide nn.Module patching (class D): 140 / 2,600 plain on 2.14.1.
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash.patching.races", description="Run one two-thread bug-class check."
    )
    parser.add_argument("bug_class", choices=list(BUG_CLASSES))
    parser.add_argument("--seconds", type=float, default=2.0, help="race duration (default 2)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    result = run_check(args.bug_class, seconds=args.seconds)
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        print(f"class {args.bug_class}: {result.failures} / {result.calls} failed")
        for kind, count in sorted(result.failure_kinds.items(), key=lambda item: -item[1]):
            print(f"  {count:8d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
