"""Run one ``Schedule`` (``stress/strategies.py``) on real threads and report what went wrong.

``run_schedule`` builds everything a schedule needs on the calling thread (compiled
functions warmed for their shapes, eager references, the flex BlockMask), releases one
thread per ``schedule.threads`` entry together through a barrier, and returns the list
of failures: exceptions, outputs that differ from eager beyond the dtype's tolerance,
compiled calls whose graph did not run (eager fallback), ``dynamic=False`` graphs that
came out dynamic, config reads that disagree, and compile/export/FX flags still set in
any thread afterwards.

Command line (the plain-vs-patched "teeth" runs of ``stress/``; derandomized, so both
modes draw the same schedules)::

    DFLASH_PATCHES=0 python -m stress.runner threads --examples 8 --json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys
import threading
import traceback
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash.compile_watch import CountingBackend, fresh_function
from dflash.masks import dflash_mask_mod
from dflash.patchtools.verify.cold_start import race_in_fresh_interpreter
from dflash.patchtools.verify.workloads import (
    SharedModule,
    export_load_step,
    export_step,
    hold_node_meta_step,
    sin_plus_one,
    sin_with_graph_break,
    trace_with_own_node_meta_step,
    traced_net,
)

from .strategies import COLD_ACTIONS, WIDTH, MaskSpec, Schedule

#: (rtol, atol) of compiled-vs-eager comparisons per dtype.
TOLERANCES = {"float32": (1e-5, 1e-5), "float64": (1e-10, 1e-10), "bfloat16": (2e-2, 2e-2)}
_BARRIER_TIMEOUT_S = 60.0
_JOIN_TIMEOUT_S = 300.0
_HEAD_DIM = 16
_fresh_ids = itertools.count()


#: nn.Module's own methods, which FX's tracer patches process-wide while it traces (class D).
_MODULE_METHODS = {name: getattr(torch.nn.Module, name) for name in ("__call__", "__getattr__")}


def _describe(exc: BaseException) -> str:
    """One line: the exception and, for wrapped ones (BackendCompilerFailed), its root cause.

    Messages spanning lines (a subprocess's traceback inside an InductorError) give their
    first and last lines: the last one names what failed over there.
    """
    root = exc
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    line = _ends(f"{type(exc).__name__}: {exc}")
    if root is not exc:
        line += f" <- {_ends(f'{type(root).__name__}: {root}')}"
    return line[:600] + _where(root)


def _where(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame of its traceback, and the one below it (a race is
    rare, so the failure line must say where it struck without a rerun)."""
    frames = traceback.extract_tb(exc.__traceback__)[-2:]
    return "".join(f" [at {frame.filename}:{frame.lineno} in {frame.name}]" for frame in reversed(frames))


def _ends(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else (lines or [""])[0]


def _module_patches_left() -> list[str]:
    """nn.Module methods not the originals while no thread traces (an FX patch, or a dispatcher of
    the fx-patcher-thread-isolation patch, left in place)."""
    return [
        f"torch.nn.Module.{name}"
        for name, method in _MODULE_METHODS.items()
        if getattr(torch.nn.Module, name) is not method
    ]


def _flags_set() -> list[str]:
    """The compile/export/FX flags the calling thread sees set (it is tracing nothing)."""
    flags = {
        "is_compiling()": torch.compiler.is_compiling(),
        "is_exporting()": torch.compiler.is_exporting(),
        "is_fx_symbolic_tracing()": torch.fx._symbolic_trace.is_fx_symbolic_tracing(),
        "has_preserved_node_meta()": torch.fx.traceback.has_preserved_node_meta(),
    }
    return [name for name, value in flags.items() if value]


def _mask_mod(spec: MaskSpec, device: torch.device):
    """The flex mask_mod of ``spec`` with its query and key lengths (see ``MaskSpec``)."""
    if spec.kind == "dflash_block":
        anchors = torch.tensor([spec.anchors], device=device)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        q_len = len(spec.anchors) * spec.block_size
        return dflash_mask_mod(anchors, valid, spec.context_len, spec.block_size), q_len, spec.context_len + q_len
    offset, window = spec.start_offset, spec.window

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx < window)

    def document(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & ((q_idx + offset) // window == kv_idx // window)

    mask_mods = {"causal": causal, "sliding_window": sliding_window, "document": document}
    return mask_mods[spec.kind], 32, 32 + offset


def _has_flex(schedule: Schedule) -> bool:
    """Whether a step calls flex_attention (then the setup compiles it once before the race)."""
    return _has_action(schedule, "flex")


def _has_action(schedule: Schedule, part: str) -> bool:
    return any(part in step.action for step in itertools.chain.from_iterable(schedule.threads))


class _Setup:
    """Everything a schedule's steps share, built on the calling thread before the race."""

    def __init__(self, schedule: Schedule, device: torch.device) -> None:
        self.device = device
        self.dtype = getattr(torch, schedule.dtype)
        self.rtol, self.atol = TOLERANCES[schedule.dtype]
        self.dynamic = schedule.dynamic
        self.backend = CountingBackend("aot_eager")
        self.recompile_limit = torch._dynamo.config.recompile_limit
        lengths = {step.length for thread in schedule.threads for step in thread}
        self.inputs = {n: torch.randn(n, WIDTH, device=device, dtype=self.dtype) for n in sorted(lengths)}
        self.shared = self.compile(fresh_function(sin_plus_one, next(_fresh_ids)))
        self.shared(self.inputs[min(lengths)])
        self.warm = self.compile(fresh_function(sin_plus_one, next(_fresh_ids)))
        for step in itertools.chain.from_iterable(schedule.threads):
            if step.action == "warm_call":
                self.warm(self.inputs[step.length])
        self.net = traced_net()
        self.eager_module = torch.nn.Linear(WIDTH, WIDTH, device=device, dtype=self.dtype)
        with torch.no_grad():
            self.eager_outputs = {n: self.eager_module(x) for n, x in self.inputs.items()}
        if _has_flex(schedule):
            self._setup_flex(schedule.mask)
        if _has_action(schedule, "export_load"):
            self.export_load = export_load_step()
        if _has_action(schedule, "shared_module"):
            self.shared_module_eager = SharedModule().to(device=device, dtype=self.dtype)
            self.shared_module = torch.compile(self.shared_module_eager, dynamic=self.dynamic, backend="aot_eager")
        if _has_action(schedule, "export"):
            self.export = export_step()

    def compile(self, fn, backend=None, dynamic="schedule"):
        return torch.compile(
            fn, backend=backend or self.backend, dynamic=self.dynamic if dynamic == "schedule" else dynamic
        )

    def _setup_flex(self, spec: MaskSpec) -> None:
        mask_mod, q_len, kv_len = _mask_mod(spec, self.device)
        self.block_mask = create_block_mask(mask_mod, 1, None, q_len, kv_len, device=self.device)
        self.q = torch.randn(1, 2, q_len, _HEAD_DIM, device=self.device, dtype=self.dtype)
        self.k, self.v = (torch.randn(1, 2, kv_len, _HEAD_DIM, device=self.device, dtype=self.dtype) for _ in "kv")
        # Inductor is flex_attention's fused path on GPU; on CPU aot_eager keeps compiles short.
        self.flex_backend = CountingBackend("inductor" if self.device.type == "cuda" else "aot_eager")
        # Static: a BlockMask fixes the sequence lengths, dynamic shapes add nothing here.
        # A fresh copy per schedule: dynamo caches per code object, and each schedule brings a new backend.
        flex = fresh_function(flex_attention, next(_fresh_ids))
        self.flex = self.compile(flex, backend=self.flex_backend, dynamic=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the "flex_attention called without torch.compile()" notice
            self.flex_reference = flex_attention(self.q, self.k, self.v, block_mask=self.block_mask)
        self.flex(self.q, self.k, self.v, block_mask=self.block_mask)

    def close(self, x: torch.Tensor, expected: torch.Tensor) -> bool:
        return torch.allclose(x.float(), expected.float(), rtol=self.rtol, atol=self.atol)


def _compiled_step(setup: _Setup, backend: CountingBackend, call, expected) -> str | None:
    before = backend.runs()
    out = call()
    if backend.runs() == before:
        return "compiled function fell back to eager (its graph did not run)"
    return None if setup.close(out, expected) else "compiled output differs from eager beyond tolerance"


def _step(setup: _Setup, action: str, length: int, thread_index: int) -> str | None:
    """Run one action; returns a failure description or None. Raises what torch raises."""
    x = setup.inputs[length]
    expected = sin_plus_one(x)
    if action == "first_compile":
        fn = setup.compile(fresh_function(sin_plus_one, next(_fresh_ids)))
        return _compiled_step(setup, setup.backend, lambda: fn(x), expected)
    if action == "recompile":
        return _compiled_step(setup, setup.backend, lambda: setup.shared(x), expected)
    if action == "warm_call":
        return _compiled_step(setup, setup.backend, lambda: setup.warm(x), expected)
    if action == "symbolic_trace":
        gm = torch.fx.symbolic_trace(setup.net)
        called = [node.target for node in gm.graph.nodes if node.op == "call_module"]
        return None if called == ["lin"] else f"symbolic_trace captured call_module targets {called}"
    if action == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(sin_plus_one)(x)
        return None if setup.close(gm(x), expected) else "make_fx graph computes a different value"
    if action == "eager_module":
        with torch.no_grad():
            out = setup.eager_module(x)
        if not isinstance(out, torch.Tensor):
            return f"eager nn.Module call returned {type(out).__name__}"
        return None if torch.equal(out, setup.eager_outputs[length]) else "eager nn.Module output changed"
    if action == "poll_is_compiling":
        for _ in range(200):
            if flags := _flags_set():
                return f"eager thread sees {', '.join(flags)}"
        return None
    if action == "config_patch":
        own = 1000 + thread_index
        outside = torch._dynamo.config.recompile_limit
        if outside != setup.recompile_limit:
            return f"config.recompile_limit reads {outside}, the main thread's value is {setup.recompile_limit}"
        with torch._dynamo.config.patch(recompile_limit=own):
            for _ in range(20):
                if (inside := torch._dynamo.config.recompile_limit) != own:
                    return f"config.recompile_limit reads {inside} inside this thread's patch to {own}"
        return None
    if action == "graph_break_compile":
        fn = setup.compile(fresh_function(sin_with_graph_break, next(_fresh_ids)))
        return _compiled_step(setup, setup.backend, lambda: fn(x), expected)
    if action == "error_on_graph_break":
        fn = setup.compile(fresh_function(sin_plus_one, next(_fresh_ids)))
        with torch._dynamo.error_on_graph_break(True):
            return _compiled_step(setup, setup.backend, lambda: fn(x), expected)
    if action == "flex_attention":
        return _compiled_step(
            setup,
            setup.flex_backend,
            lambda: setup.flex(setup.q, setup.k, setup.v, block_mask=setup.block_mask),
            setup.flex_reference,
        )
    if action == "eager_flex_attention":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(setup.q, setup.k, setup.v, block_mask=setup.block_mask)
        return None if setup.close(out, setup.flex_reference) else "eager flex_attention output differs"
    if action == "own_node_meta_trace":
        return trace_with_own_node_meta_step(f"thread {thread_index}")()
    if action == "hold_node_meta":
        return hold_node_meta_step(f"thread {thread_index}")()
    if action == "export_load":
        return setup.export_load()
    if action == "export":
        return setup.export()
    if action == "shared_module":
        return _shared_module_step(setup, length)
    raise ValueError(f"unknown action {action!r}; see stress.strategies.ACTIONS")


def _shared_module_step(setup: _Setup, length: int) -> str | None:
    """Forward and backward of the shared compiled module on a tensor whose rank and sizes follow
    ``length`` (so threads recompile it while others call it), against the eager module."""
    shape = [length] * (length % 3) + [8]
    x = torch.randn(*shape, device=setup.device, dtype=setup.dtype, requires_grad=True)
    out = setup.shared_module(x)
    (grad,) = torch.autograd.grad(out, x)
    x_eager = x.detach().requires_grad_()
    expected = setup.shared_module_eager(x_eager)
    (expected_grad,) = torch.autograd.grad(expected, x_eager)
    if not setup.close(out, expected) or not setup.close(grad, expected_grad):
        return f"shared compiled module gave a wrong value or gradient for shape {shape}"
    return None


def unsupported(schedule: Schedule, device: torch.device | str) -> str | None:
    """Why ``schedule`` cannot run on ``device`` whatever the threads do, or None.

    Inductor's flex_attention Triton kernels do not compile for float64 (a triton
    CompilationError in forward_inner, on plain torch too: H200, torch 2.11), and
    any schedule with a flex action compiles flex_attention in its setup.
    """
    if _has_flex(schedule) and schedule.dtype == "float64" and torch.device(device).type == "cuda":
        return "inductor's flex_attention kernels have no float64 on CUDA"
    return None


def run_schedule(schedule: Schedule, device: torch.device | str = "cpu") -> list[str]:
    """Run ``schedule`` on ``device``; returns one line per failure (empty: all properties held)."""
    if _has_action(schedule, "cold_"):
        return _run_cold(schedule)
    device = torch.device(device)
    failures: list[str] = []
    lock = threading.Lock()
    with _main_thread_config(schedule.recompile_limit):
        try:
            setup = _Setup(schedule, device)
        except Exception as exc:  # e.g. a flag an earlier schedule leaked makes the warm-up compile raise
            return [f"main thread, before the race: {_describe(exc)}"]
        barrier = threading.Barrier(len(schedule.threads), timeout=_BARRIER_TIMEOUT_S)

        def report(thread_index: int, what: str) -> None:
            with lock:
                failures.append(f"thread {thread_index}: {what}")

        def run_thread(thread_index: int) -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            barrier.wait()
            for step in schedule.threads[thread_index]:
                try:
                    problem = _step(setup, step.action, step.length, thread_index)
                except Exception as exc:  # every exception is a failure of the schedule
                    problem = _describe(exc)
                if problem:
                    report(thread_index, f"{step.action}(length={step.length}): {problem}")
            if flags := _flags_set():
                report(thread_index, f"after its steps still sees {', '.join(flags)}")

        threads = [threading.Thread(target=run_thread, args=(i,), daemon=True) for i in range(len(schedule.threads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                failures.append(f"a thread did not finish within {_JOIN_TIMEOUT_S:.0f} s (hang)")
        if flags := _flags_set():
            failures.append(f"main thread: after the race still sees {', '.join(flags)}")
        if patched := _module_patches_left():
            failures.append(f"after the race FX's patches are still installed on {', '.join(patched)}")
        if schedule.dynamic is False and setup.backend.dynamic_graphs:
            failures.append(f"{setup.backend.dynamic_graphs} graph(s) compiled with dynamic=False came out dynamic")
    return failures


#: What each first call of a cold schedule is to ``dflash.patchtools.verify.cold_start``.
_FIRST_CALLS = {
    "cold_export": "export",
    "cold_compile_eager": "compile:eager",
    "cold_compile_aot_eager": "compile:aot_eager",
}


def _run_cold(schedule: Schedule) -> list[str]:
    """A schedule of first calls (``COLD_ACTIONS``, one per thread) in a fresh interpreter: its
    imports are what races, which this process did long ago."""
    first_calls = tuple(_FIRST_CALLS[steps[0].action] for steps in schedule.threads)
    problems = race_in_fresh_interpreter(first_calls)
    if len(problems) != len(first_calls):  # the child as a whole: a crash or a timeout
        return [f"the fresh interpreter: {problem}" for problem in problems]
    return [f"thread {index}: {problem}" for index, problem in enumerate(problems) if problem is not None]


@contextlib.contextmanager
def _main_thread_config(recompile_limit: int | None):
    """Assign ``recompile_limit`` plainly on this thread for the duration (class F), then restore it."""
    if recompile_limit is None:
        yield
        return
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = recompile_limit
    try:
        yield
    finally:
        torch._dynamo.config.recompile_limit = before


@functools.cache
def warm_imports(device: str = "cpu") -> None:
    """Run every action once, single-threaded, on this thread (first-compile import races are out of scope).

    Raises ``RuntimeError`` when an action fails even without other threads.
    """
    from .strategies import ACTIONS, MaskSpec, Step

    spec = MaskSpec("causal", 4, 0, 8, 32, (1,))
    for action in ACTIONS:
        if action in COLD_ACTIONS:
            continue  # each of their schedules runs in a fresh interpreter
        failures = run_schedule(Schedule(((Step(action, 2),),), "float32", None, spec), device)
        if failures:
            raise RuntimeError(f"warm-up of {action} failed single-threaded: {failures}")


def main(argv: list[str] | None = None) -> int:
    from hypothesis import HealthCheck, Phase, given, settings

    from .scenarios import SCENARIOS

    parser = argparse.ArgumentParser(prog="python -m stress.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--examples", type=int, default=8, help="schedules to run (default %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON line")
    args = parser.parse_args(argv)
    warm_imports(args.device)
    failing: list[list[str]] = []
    runs = 0

    @settings(
        max_examples=args.examples,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(SCENARIOS[args.scenario].schedules)
    def run(schedule):
        nonlocal runs
        runs += 1
        if failures := run_schedule(schedule, args.device):
            failing.append(failures)

    run()
    result = {"examples": runs, "failing": len(failing), "example_failure": failing[0][0] if failing else None}
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
