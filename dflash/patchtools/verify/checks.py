"""One two-thread check per bug class (:mod:`.catalogue`), run in this interpreter.

Each check warms the torch modules it needs on the calling thread (the very first compile
racing on imports is out of scope), then runs an "aggressor" step and a "victim" step
(:mod:`.workloads`) on two threads released together by a barrier, for a set number of
seconds, on CPU tensors. Every checked operation counts as a call; every exception, wrong
result, eager fallback of a compiled function or leaked flag counts as a failure.

On plain torch a check may leave torch's process-global flags set, which would poison any later
compile in the same process: run each in a fresh interpreter (:mod:`.runner`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import torch

from dflash.compile_watch import fresh_function, recompile_limit_name
from dflash.patchtools.verify.catalogue import require_class
from dflash.patchtools.verify.workloads import (
    COUNTING,
    IS_EXPORTING,
    SharedModule,
    compile_new_functions_step,
    compiled_call,
    export_load_step,
    export_save_step,
    export_step,
    hold_node_meta_step,
    make_fx_of_cond_step,
    poll_session_flags_step,
    shared_module_step,
    sin_plus_one,
    sin_with_graph_break,
    symbolic_trace_step,
    trace_with_own_node_meta_step,
    traced_net,
    warm_compiled_call_step,
    warm_compiled_function,
)

# Why a join can take long: a compile in flight when the time is up must finish.
JOIN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: ``failures`` out of ``calls`` checked operations.

    ``example_error`` is the text of the first failure seen (exception type and
    message, or what went wrong), ``None`` when nothing failed; ``failure_kinds``
    counts failures by the first line of their text (at most 100 characters).
    ``series`` maps each concern of the patch series to its state in the interpreter that ran
    the check and the variant it applied (``"applied generated/.../torch-2.13.patch"``); empty
    when the import hook was off.
    """

    calls: int
    failures: int
    example_error: str | None = None
    failure_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    series: dict[str, str] = dataclasses.field(default_factory=dict)


class Tally:
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


def race(tally: Tally, seconds: float, *loops: Callable[[], str | None]) -> None:
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
        thread.join(JOIN_TIMEOUT_S)
        if thread.is_alive():
            tally.fail(f"a racing thread did not finish within {JOIN_TIMEOUT_S:.0f} s of the stop")


#: What compile_wrapper asks about the FX tracing flag: is_fx_symbolic_tracing() from torch 2.9, is_fx_tracing() before.
_FX_FLAG_READER = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", torch.fx._symbolic_trace.is_fx_tracing)


def check_flags_clean(tally: Tally) -> None:
    """After a race no thread is tracing, compiling or exporting: every global flag must read False."""
    readers = {
        f"torch.fx._symbolic_trace.{_FX_FLAG_READER.__name__}()": _FX_FLAG_READER,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch.compiler.is_exporting()": IS_EXPORTING,
    }
    leaked = [name for name, reader in readers.items() if reader is not None and reader()]
    if leaked:
        tally.fail("left set after all threads finished: " + ", ".join(leaked))
    else:
        tally.ok()


# --- one check per class ------------------------------------------------------------------------


def _shared_module_steps(threads: int) -> list[Callable[[], str | None]]:
    """One compiled module (dynamic shapes, AOT backend) for ``threads`` callers, forward and
    backward on shapes that change, so recompiles overlap calls (:func:`shared_module_step`)."""
    eager = SharedModule()
    compiled = torch.compile(eager, dynamic=True, backend="aot_eager")
    steps = [shared_module_step(compiled, eager, seed) for seed in range(threads)]
    steps[0]()
    return steps


def _check_a(tally: Tally, seconds: float) -> None:
    warm, x = warm_compiled_function()
    compile_new = compile_new_functions_step("aot_eager")
    compile_new()
    race(tally, seconds / 2, compile_new, warm_compiled_call_step(warm, x))
    race(tally, seconds / 2, *_shared_module_steps(3))


def _check_b(tally: Tally, seconds: float) -> None:
    warm, x = warm_compiled_function()
    trace = symbolic_trace_step(traced_net())
    trace()
    race(tally, seconds / 2, trace, warm_compiled_call_step(warm, x))
    race(tally, seconds / 2, trace, *_shared_module_steps(3))


def _check_c(tally: Tally, seconds: float) -> None:
    import warnings

    compile_new = compile_new_functions_step("eager")
    compile_new()
    race(tally, seconds / 2, compile_new, poll_session_flags_step(check_compile_handoff=False))

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
        race(tally, seconds / 2, export, poll_session_flags_step(check_compile_handoff=True))


def _check_d(tally: Tally, seconds: float) -> None:
    from torch.fx._lazy_graph_module import _get_graph_module_cls
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2, 4)

    def eager_graph_module_step() -> str | None:
        # The class every GraphModule made in this thread gets (symbolic_trace's included); probed
        # directly, as a symbolic_trace here would make the other thread's compiled calls fail (B).
        if _get_graph_module_cls() is not torch.fx.GraphModule:
            return "graph modules made here are _LazyGraphModule (another thread's compile turned them on)"
        return None

    # First: on plain torch the races below can leave the FX tracing flag set, which fails every
    # later compiled call (B) before it compiles.
    compile_step = compile_new_functions_step("eager")
    compile_step()
    race(tally, seconds / 6, compile_step, eager_graph_module_step)

    trace = symbolic_trace_step(traced_net())
    eager = torch.nn.Linear(4, 4)
    with torch.no_grad():
        expected = eager(x)

    def eager_call() -> str | None:
        with torch.no_grad():
            out = eager(x)
        if not isinstance(out, torch.Tensor):
            return f"an eager nn.Module call returned {type(out).__name__} (captured by another thread's trace)"
        return None if torch.equal(out, expected) else "an eager nn.Module call returned a wrong value"

    trace()
    race(tally, seconds / 2, trace, eager_call)

    def make_fx_step() -> str | None:
        gm = make_fx(sin_plus_one)(x)
        targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return None if len(targets) == 2 else f"make_fx traced {targets}, expected sin and add"

    make_fx_step()
    race(tally, seconds / 6, make_fx_step, make_fx_step)
    # A higher-order op's branches re-enter the calling thread's make_fx trace, not the other's.
    of_cond = make_fx_of_cond_step()
    of_cond()
    race(tally, seconds / 6, of_cond, make_fx_step)


def _check_e(tally: Tally, seconds: float) -> None:
    config = torch._dynamo.config
    name = recompile_limit_name()
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

    race(tally, seconds, patch_step(base + 1000), patch_step(base + 2000))


def _check_f(tally: Tally, seconds: float) -> None:
    config = torch._dynamo.config
    name = recompile_limit_name()
    base = getattr(config, name)
    raised = base + 8
    # Shapes beyond the default limit: with the raised limit every call must still run a graph.
    shapes = range(1, base + 4)

    def worker() -> None:
        deadline = time.monotonic() + seconds
        fn = torch.compile(fresh_function(sin_plus_one, 0), backend=COUNTING, dynamic=False)
        for n in shapes:
            x = torch.randn(n)
            value = getattr(config, name)
            if value != raised:
                tally.fail(f"worker thread reads config.{name} = {value}; the main thread assigned {raised}")
            else:
                tally.ok()
            out, ran_graph = compiled_call(fn, x)
            if not ran_graph:
                tally.fail(f"compiled function fell back to eager on recompile {n} (limit {raised} assigned)")
            elif not torch.allclose(out, sin_plus_one(x)):
                tally.fail("compiled function returned a wrong value")
            else:
                tally.ok()
            if time.monotonic() > deadline:
                break

    warm_compiled_function()
    setattr(config, name, raised)
    try:
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        thread.join(seconds + JOIN_TIMEOUT_S)
        if thread.is_alive():
            tally.fail("the worker thread did not finish")
    finally:
        setattr(config, name, base)


def _check_g(tally: Tally, seconds: float) -> None:
    if not hasattr(torch._dynamo, "error_on_graph_break"):
        return  # before torch 2.9 there is no such region to leak (catalogue.applies_to says so)
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
    race(tally, seconds / 2, hold_error_on_graph_break, compile_with_graph_break)

    # One instance entered from both threads, as a decorated function's is: each thread's exit
    # must put back that thread's own value, not the one the other thread entered with.
    allow_graph_breaks = torch._dynamo.error_on_graph_break(False)

    def enter_it_from_a_region() -> None:
        with torch._dynamo.error_on_graph_break(True):
            allow_graph_breaks(time.sleep)(0.002)

    def compile_in_it_and_after() -> str | None:
        return allow_graph_breaks(compile_with_graph_break)() or compile_with_graph_break()

    race(tally, seconds / 2, enter_it_from_a_region, compile_in_it_and_after)


def _check_h(tally: Tally, seconds: float) -> None:
    import warnings

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

    trace = symbolic_trace_step(traced_net())
    trace()
    race(tally, seconds, trace, eager_flex)


def _check_i(tally: Tally, seconds: float) -> None:
    import torch.fx.traceback as fx_traceback

    trace = trace_with_own_node_meta_step("victim")
    trace()
    race(tally, seconds, hold_node_meta_step("aggressor"), trace)
    left = {
        "has_preserved_node_meta()": fx_traceback.has_preserved_node_meta(),
        "current_meta": fx_traceback.get_current_meta(),
    }
    if any(left.values()):
        tally.fail(f"node metadata left after all threads finished: {left}")
    else:
        tally.ok()


def _check_j(tally: Tally, seconds: float) -> None:
    # Half the time two loads (the deserializer), half two saves (the FakeTensor reducer in copyreg).
    load = export_load_step()
    load()
    race(tally, seconds / 2, load, load)
    save = export_save_step()
    save()
    race(tally, seconds / 2, save, save)


def _check_k(tally: Tally, seconds: float) -> None:
    # Each race needs a fresh process, which takes longer than a check's usual seconds: MIN_RACES
    # run whatever the time, more while time is left.
    from dflash.patchtools.verify.cold_start import MIN_RACES, race_in_fresh_interpreter

    deadline = time.monotonic() + seconds
    for race_number in itertools.count(1):
        for problem in race_in_fresh_interpreter():
            tally.check(lambda problem=problem: problem)
        if race_number >= MIN_RACES and time.monotonic() >= deadline:
            break


def _check_l(tally: Tally, seconds: float) -> None:
    export = export_step()
    compile_new = compile_new_functions_step("aot_eager")
    export()
    compile_new()
    race(tally, seconds, export, compile_new)


CHECKS: dict[str, Callable[[Tally, float], None]] = {
    "A": _check_a,
    "B": _check_b,
    "C": _check_c,
    "D": _check_d,
    "E": _check_e,
    "F": _check_f,
    "G": _check_g,
    "H": _check_h,
    "I": _check_i,
    "J": _check_j,
    "K": _check_k,
    "L": _check_l,
}


def run_check(bug_class: str, *, seconds: float) -> CheckResult:
    """Run the two-thread check for ``bug_class`` in this interpreter for about ``seconds`` (wall clock).

    Returns the number of checked operations and of failures, with the first failure's
    text. Raises ``ValueError`` for an unknown class or a non-positive duration. On plain
    torch the check may leave torch's global flags set: prefer ``run_check_subprocess``.
    """
    require_class(bug_class)
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    tally = Tally()
    CHECKS[bug_class](tally, seconds)
    check_flags_clean(tally)
    return tally.result()
