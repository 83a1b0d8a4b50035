"""FX's thread-scoped patches leave no trace once the last trace ends (patch 0003).

While a thread traces, a dispatcher holds the place of ``nn.Module.__call__``/``__getattr__`` (and
of each autowrapped global) so that only the tracing thread sees the tracer's wrappers. The series
used to keep the two ``nn.Module`` dispatchers installed for the life of the process, which defeated
dynamo's identity checks against the original methods (``torch/_dynamo/utils.py`` keeps them): later
compiles took their slow paths (5.5x the bytecode on a 30-block ``nn.Sequential``), and PyTorch's
``test/dynamo/test_compile.py::InPlaceCompilationTests::test_inline_script_module_graph_break``
failed patched after an earlier trace (``IndexError: pop from empty list``). Now the originals come
back when the last trace ends, and a dynamo compile that reads a dispatcher while another thread
traces takes it for the original (``torch._dynamo.utils.fx_unpatched``), so that its guards still
hold once the original is back. A compile that inlines the dispatcher of a global (``math.sqrt``, a
builtin that ``torch.fx.wrap`` shadows) guards on the global and on what the dispatcher's code reads,
globals of its own, so its guards build whether the trace ends before or after the compile does.

Integration tier: fresh interpreters, plain (``DFLASH_PATCHES=0``) and patched.
"""

from __future__ import annotations

import pytest
from tiny import script_result

pytest.importorskip("torch")

ORIGINALS_AFTER_TRACES = """
import json, math
import torch, torch.fx
from torch._dynamo.utils import unpatched_nn_module_call, unpatched_nn_module_getattr
from torch.fx.experimental.proxy_tensor import make_fx


def originals():
    return (
        torch.nn.Module.__call__ is unpatched_nn_module_call
        and torch.nn.Module.__getattr__ is unpatched_nn_module_getattr
        and math.__dict__["sqrt"] is sqrt
    )


sqrt = math.sqrt


class Root(torch.nn.Module):
    def forward(self, x):
        return math.sqrt(2.0) * torch.nn.functional.relu(x)


seen = {"before": originals()}
torch.fx.symbolic_trace(Root())
seen["after symbolic_trace"] = originals()
make_fx(lambda x: Root()(x))(torch.randn(2))
seen["after make_fx"] = originals()
torch.compile(Root(), backend="aot_eager")(torch.randn(2))
seen["after an aot_eager compile"] = originals()
print(json.dumps(seen))
"""

# PyTorch's test (test/dynamo/test_compile.py, v2.13.0), after one earlier trace in the process and
# with torch._dynamo.test_case's default nested_graph_breaks=True.
SCRIPT_MODULE_GRAPH_BREAK = """
import json
import torch, torch._dynamo.testing

torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))


class OuterModule(torch.nn.Module):
    def __init__(self, sub):
        super().__init__()
        self.sub = sub

    def forward(self, x):
        return self.sub(x)


outer = OuterModule(torch.jit.script(torch.nn.Linear(3, 3)))
cnt = torch._dynamo.testing.CompileCounter()
with torch._dynamo.config.patch(nested_graph_breaks=True):
    torch.compile(outer, backend=cnt)(torch.randn(2, 3))
print(json.dumps(cnt.frame_count))
"""

# Thread B's symbolic_trace stays open (its dispatchers installed) while thread A's dynamo traces a
# model; A's backend lets B's trace end (the originals come back) before dynamo builds A's guards,
# then A calls the compiled model again, which must run the same graph.
COMPILE_DURING_ANOTHER_THREADS_TRACE = """
import json, threading
import torch, torch.fx

opened, release = threading.Event(), threading.Event()


class Holding(torch.nn.Module):
    def forward(self, x):
        opened.set()
        release.wait(60)
        return x


b = threading.Thread(target=lambda: torch.fx.symbolic_trace(Holding()), daemon=True)
b.start()
opened.wait(60)
frames = []


def ending_backend(gm, example_inputs):
    frames.append(gm)
    release.set()
    b.join(60)
    return gm.forward


model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)])
compiled = torch.compile(model, backend=ending_backend)
x = torch.randn(2, 4)
try:
    right = all(torch.allclose(compiled(x), model(x)) for _ in range(2))
    result = {"right": right, "frames": len(frames)}
except Exception as e:
    result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(result))
"""


# Another thread's symbolic_trace held open (its dispatchers installed) from open_trace() to end_trace().
HELD_TRACE = """
import json, math, sys, threading, types
import torch, torch.fx


def holding(x):
    opened.set()
    release.wait(60)
    return x


def open_trace():
    global opened, release, tracing
    opened, release = threading.Event(), threading.Event()
    tracing = threading.Thread(target=lambda: torch.fx.symbolic_trace(holding), daemon=True)
    tracing.start()
    opened.wait(60)


def end_trace():
    release.set()
    tracing.join(60)
"""

# Thread B's symbolic_trace stays open (math.sqrt's dispatcher installed, and the one of a builtin
# that the module of `wrapped_len` shadows with torch.fx.wrap("len")) while thread A's dynamo inlines
# that dispatcher. "mid": A's backend lets B's trace end (the originals come back) before dynamo
# builds A's guards; "after": B's trace ends once the compile is done, and A's next call recompiles.
# Seen as `InternalTorchDynamoError: AttributeError: 'builtin_function_or_method' object has no
# attribute '__closure__'` (and `KeyError: len`) in the stress suite's flex_attention scenario.
COMPILE_INLINING_A_PATCHED_GLOBAL = (
    HELD_TRACE
    + """
lens = types.ModuleType("wrapped_len")
exec('import torch.fx\\ntorch.fx.wrap("len")\\ndef f(x):\\n    return x * len(x.shape)\\n', lens.__dict__)
sys.modules["wrapped_len"] = lens


def sqrt_f(x):
    return x * math.sqrt(x.size(-1))


def run(fn, ends):
    open_trace()
    dispatched = all(type(f) is types.FunctionType for f in (math.sqrt, lens.__dict__.get("len")))
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        if ends == "mid":
            end_trace()
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    x = torch.randn(2, 4)
    try:
        right = torch.allclose(compiled(x), fn(x))
        end_trace()
        right = right and all(torch.allclose(compiled(x), fn(x)) for _ in range(2))
        return {"dispatched": dispatched, "right": right, "frames": len(frames)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        end_trace()


cases = [(name, fn, ends) for name, fn in (("math.sqrt", sqrt_f), ("len", lens.f)) for ends in ("mid", "after")]
print(json.dumps({f"{name} {ends}": run(fn, ends) for name, fn, ends in cases}))
"""
)

# A module's torch.fx.wrap'd global `g` is rebound between two traces of another thread (a reload,
# mock.patch.object); a compile that inlined the first trace's dispatcher must not run the first `g`
# under the second trace's dispatcher (dynamo guards an inlined function by its __code__).
REBOUND_WRAPPED_GLOBAL = (
    HELD_TRACE
    + """
module = types.ModuleType("wrapped_g")
source = 'import torch.fx\\ndef g(x):\\n    return x + 1\\ntorch.fx.wrap("g")\\ndef f(x):\\n    return g(x) * 2\\n'
exec(source, module.__dict__)
sys.modules["wrapped_g"] = module


def during_a_trace(call):
    open_trace()
    try:
        return call()
    finally:
        end_trace()


compiled, x = torch.compile(module.f, backend="eager"), torch.zeros(2)
both = lambda: (compiled(x).tolist(), module.f(x).tolist())
seen = {"during a trace": during_a_trace(both)}
module.g = lambda t: t + 100
seen["rebound, no trace"] = both()
seen["rebound, during a trace"] = during_a_trace(both)
print(json.dumps(seen))
"""
)


# Another thread's compile installs dynamo's globals (__compiled_fn_*, __builtins_dict___*) in the
# module dict a trace scans for autowrapped functions. On Python 3.11 an allocation can collect
# garbage, and the finalizers it runs can let that thread in: inside a snapshot that allocates while it
# copies (list(items()); dict.copy() between cloning the entries and reading their count), the copy
# is torn. Here a finalizer stands in for the other thread, adding (or removing) a global at every
# collection, and the threshold makes one collect every few allocations. Plain torch's scan iterates
# the dict itself and allocates nothing the collector tracks between entries, so it passes this and
# is exposed only to a thread switch at a bytecode boundary (the soak's race). From 3.12 a collection
# waits for the eval loop, so there every snapshot passes.
AUTOWRAP_SCAN_WHILE_GLOBALS_CHANGE = """
import gc, itertools, json, os
import torch.fx._symbolic_trace as st

change = os.environ["GLOBALS_CHANGE"]
scope = {f"global_{i}": i for i in range(10_000)}  # more entries than tuple free lists hold
names = itertools.count()
changes = [0]
armed = [False]


class ChangesAGlobal:
    def __init__(self):
        self.cycle = self  # only the cyclic collector frees it

    def __del__(self):
        if armed[0]:
            if change == "add":
                scope[f"__compiled_fn_{next(names)}"] = None
            else:
                scope.pop(f"global_{next(names)}")
            changes[0] += 1
            ChangesAGlobal()  # garbage for the next collection


held = [{} for _ in range(200)]  # empties the dict free list: a new dict is a fresh allocation
ChangesAGlobal()
threshold = gc.get_threshold()
armed[0] = True
gc.set_threshold(1)
try:
    with st._Patcher() as patcher:
        st._autowrap_check(patcher, scope, set())
    outcome = "scanned"
except RuntimeError as error:
    outcome = str(error)
finally:
    armed[0] = False
    gc.set_threshold(*threshold)
thread_scoped = hasattr(st, "_thread_scoped_patches")
print(json.dumps({"outcome": outcome, "changed": changes[0] > 0, "thread_scoped": thread_scoped}))
"""


def test_module_methods_and_globals_are_the_originals_once_traces_end():
    plain = script_result(ORIGINALS_AFTER_TRACES, patched=False)
    assert all(plain.values()), plain
    patched = script_result(ORIGINALS_AFTER_TRACES, patched=True)
    assert all(patched.values()), f"a dispatcher stayed after the traces ended: {patched}"


def test_pytorchs_inline_script_module_graph_break_after_a_trace():
    assert script_result(SCRIPT_MODULE_GRAPH_BREAK, patched=False) == 0
    assert script_result(SCRIPT_MODULE_GRAPH_BREAK, patched=True) == 0


def test_a_compile_during_another_threads_trace_keeps_its_guards_when_the_trace_ends():
    plain = script_result(COMPILE_DURING_ANOTHER_THREADS_TRACE, patched=False)
    assert "error" in plain, f"plain torch compiled through the other thread's tracer: {plain}"
    patched = script_result(COMPILE_DURING_ANOTHER_THREADS_TRACE, patched=True)
    assert patched == {"right": True, "frames": 1}, patched


def test_a_compile_that_inlined_a_patched_global_builds_its_guards_when_the_trace_ends():
    patched = script_result(COMPILE_INLINING_A_PATCHED_GLOBAL, patched=True)
    assert patched == {
        "math.sqrt mid": {"dispatched": True, "right": True, "frames": 1},
        "math.sqrt after": {"dispatched": True, "right": True, "frames": 2},
        "len mid": {"dispatched": True, "right": True, "frames": 1},
        "len after": {"dispatched": True, "right": True, "frames": 2},
    }, patched


def test_a_compile_that_inlined_a_dispatcher_runs_the_global_a_later_trace_patches():
    patched = script_result(REBOUND_WRAPPED_GLOBAL, patched=True)
    assert all(compiled == eager for compiled, eager in patched.values()), patched


@pytest.mark.parametrize("change", ["add", "remove"])
def test_the_autowrap_scan_survives_globals_changed_while_it_snapshots_them(change, monkeypatch):
    monkeypatch.setenv("GLOBALS_CHANGE", change)
    patched = script_result(AUTOWRAP_SCAN_WHILE_GLOBALS_CHANGE, patched=True)
    assert patched == {"outcome": "scanned", "changed": True, "thread_scoped": True}, patched
