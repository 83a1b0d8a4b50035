"""Per-thread state reads, on the autograd device threads of a traced backward, what the tracing thread reads.

Non-strict export and ``make_fx`` traces of a backward call ``torch.autograd.grad`` under ``make_fx``; for
CUDA tensors (fake ones included) the autograd engine runs the backward's nodes on its per-device
threads, which carry the launching thread's ATen thread-local state but not its Python context.
Plain torch kept this state in module globals, so a backward formula there read the compiling
thread's values (``torch.utils.checkpoint`` reads the non-strict tracing flag); the series keeps it
per thread, in ContextVars that the device threads read through the launching thread's context,
which ``torch.autograd.graph._engine_run_backward`` stashes in that ATen state (patch 0000).

- ``test_traced_backwards_carry_the_launching_threads_context`` (CPU): inside a backward traced by
  ``make_fx`` the stash holds the launching thread's values; an eager backward needs none.
- ``test_readers_take_the_launch_context_where_their_own_is_unset`` (CPU): a thread with that
  stash in its ATen state, as a device thread has while it runs such a backward's nodes, reads
  every per-thread value of the series as the launching thread does.
- ``test_backward_formulas_on_the_cuda_device_thread_read_the_tracing_threads_state`` (CUDA):
  a custom op's backward, run by ``make_fx`` of ``torch.autograd.grad`` over fake CUDA tensors
  with every per-thread value set (and, from 2.12, under the non-strict tracing flag alone),
  records what it reads on the device thread. (AOTAutograd's joint trace under ``torch.compile``
  ran the same backward formula on the compiling thread itself: H200, torch 2.11.)

Integration tier: fresh interpreters.
"""

from __future__ import annotations

import pytest
from tiny import script_result

torch = pytest.importorskip("torch")

# The per-thread values of the series and how to set them; a value torch itself keeps (the FX
# tracing flag from 2.14 on, upstream's threading.local) is not the series' to carry.
STATE = """
import contextlib, json, threading
import torch, torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx import _lazy_graph_module as lazy, _symbolic_trace as symbolic_trace

RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def read():
    values = {
        "is_compiling": torch.compiler.is_compiling(),
        "lazy_graph_module": lazy._use_lazy_graph_module_flag,
        "config_patch": torch._inductor.config.max_autotune,
        # What AOTAutograd's backward hooks read and update there (stack traces, seq_nr).
        "preserve_node_meta": fx_traceback.has_preserved_node_meta(),
        "node_meta": (fx_traceback.get_current_meta().get("custom") or {}).get("thread"),
    }
    if hasattr(torch.compiler, "is_exporting"):
        values["is_exporting"] = torch.compiler.is_exporting()
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        values["non_strict_tracing"] = torch.compiler._is_non_strict_tracing()
    if RELEASE < (2, 14):
        values["fx_tracing"] = symbolic_trace._is_fx_tracing_flag
    if hasattr(torch._dynamo.utils, "_get_error_on_graph_break"):
        values["error_on_graph_break"] = torch._dynamo.utils._get_error_on_graph_break()
    return values


@contextlib.contextmanager
def everything_set():
    flags = {"compiling": True}
    if hasattr(torch.compiler, "is_exporting"):
        flags["exporting"] = True
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        flags["non_strict_tracing"] = True
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.compiler._session_flags_context(**flags))
        stack.enter_context(lazy._use_lazy_graph_module(True))
        stack.enter_context(torch._inductor.config.patch(max_autotune=True))
        stack.enter_context(fx_traceback.preserve_node_meta())
        fx_traceback.get_current_meta()["custom"] = {"thread": "launching"}
        if RELEASE < (2, 14):
            stack.enter_context(symbolic_trace._is_fx_tracing_context(True))
        if hasattr(torch._dynamo.utils, "_get_error_on_graph_break"):
            previous = torch._dynamo.utils._get_error_on_graph_break()
            torch._dynamo.utils._set_error_on_graph_break(True)
            stack.callback(torch._dynamo.utils._set_error_on_graph_break, previous)
        yield
"""

LAUNCH_CONTEXT = (
    STATE
    + """
from torch.fx.experimental.proxy_tensor import make_fx
seen = {}


class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        stashed = torch._C._is_key_in_tls("context") and torch._C._get_obj_in_tls("context")
        seen.setdefault("stash", []).append(bool(stashed))
        if stashed and "values" not in seen:  # the traced backward's, not the eager one's
            seen["values"] = stashed.run(read)
        return grad * 2


def grad_of(x):
    return torch.autograd.grad(Probe.apply(x).sum(), x)[0]


with everything_set():
    expected = read()
    make_fx(grad_of)(torch.randn(3, requires_grad=True))
x = torch.randn(3, requires_grad=True)
Probe.apply(x).sum().backward()
print(json.dumps({"expected": expected, "traced": seen["stash"][0], "eager": seen["stash"][1],
                  "values": seen.get("values")}))
"""
)

READERS = (
    STATE
    + """
import contextvars


# Before 2.12 the binding keeps the object without a reference of its own; the series' variant gives it one.
stash_in_tls = torch._utils._stash_in_tls if RELEASE < (2, 12) else torch._C._stash_obj_in_tls


def as_device_thread(context, stash):
    # What a device thread holds while it runs a node of the launching thread's traced backward:
    # its ATen state, with its context stashed by _engine_run_backward, and the backward counted.
    if stash:
        stash_in_tls("context", context)
        with torch._utils._traced_backwards_lock:
            torch._utils._traced_backwards += 1
    try:
        return read()
    finally:
        if stash:
            with torch._utils._traced_backwards_lock:
                torch._utils._traced_backwards -= 1
            stash_in_tls("context", None)


out = {}
with everything_set():  # the launching thread waits in its backward meanwhile
    launching = read()
    context = contextvars.copy_context()
    for stash in (False, True):
        thread = threading.Thread(target=lambda s=stash: out.__setitem__(s, as_device_thread(context, s)))
        thread.start()
        thread.join(60)
print(json.dumps({"launching": launching, "without": out[False], "with": out[True], "defaults": read()}))
"""
)

CUDA_BACKWARD = (
    STATE
    + """
from torch.fx.experimental.proxy_tensor import make_fx
records = []  # (side, thread, values) in the order the probe ran


@torch.library.custom_op("dflash_test::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@probe.register_fake
def _(x):
    records.append(("forward", threading.get_ident(), read()))
    return torch.empty_like(x)


def backward(ctx, grad):
    records.append(("backward", threading.get_ident(), read()))
    return grad * 2


probe.register_autograd(backward)


def traced_pair():
    # The first backward record and the forward record just before it.
    first = next(i for i, r in enumerate(records) if r[0] == "backward")
    forward = next(r for r in reversed(records[:first]) if r[0] == "forward")
    return forward[1:], records[first][1:]


def grad_of_probe(t):
    return torch.autograd.grad(probe(t).sum(), t)[0]


x = torch.randn(8, device="cuda", requires_grad=True)
patched = hasattr(torch.compiler, "_session_flags_context")  # the series' setter; plain shows the threads only
with everything_set() if patched else contextlib.nullcontext():
    make_fx(grad_of_probe, tracing_mode="fake")(x)
sessions = {"make_fx": traced_pair()}
if hasattr(torch.compiler, "_non_strict_tracing_context"):  # torch >= 2.12
    records.clear()
    with torch.compiler._non_strict_tracing_context():
        make_fx(grad_of_probe, tracing_mode="fake")(x)
    sessions["non-strict make_fx"] = traced_pair()
print(json.dumps({name: {"forward_thread": f[0], "backward_thread": b[0], "forward": f[1], "backward": b[1]}
                  for name, (f, b) in sessions.items()}))
"""
)


def test_traced_backwards_carry_the_launching_threads_context():
    patched = script_result(LAUNCH_CONTEXT, patched=True)
    assert patched["traced"], "no launching thread's context during a backward traced by make_fx"
    assert patched["values"] == patched["expected"], patched
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12):
        assert not patched["eager"], "the series stashed a context for an eager backward"


def test_readers_take_the_launch_context_where_their_own_is_unset():
    patched = script_result(READERS, patched=True)
    assert all(patched["launching"].values()), patched["launching"]
    assert not any(patched["without"].values()), f"per-thread state leaked to another thread: {patched}"
    assert patched["with"] == patched["launching"], patched
    assert not any(patched["defaults"].values()), patched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the CUDA autograd device thread")
def test_backward_formulas_on_the_cuda_device_thread_read_the_tracing_threads_state():
    plain = script_result(CUDA_BACKWARD, patched=False, timeout_s=600)
    for name, session in plain.items():
        assert session["backward_thread"] != session["forward_thread"], f"{name}: backward ran on the tracing thread"
    patched = script_result(CUDA_BACKWARD, patched=True, timeout_s=600)
    assert all(patched["make_fx"]["forward"].values()), f"the trace ran without every value set: {patched}"
    for name, session in patched.items():
        assert session["backward_thread"] != session["forward_thread"], name
        assert session["backward"] == session["forward"], f"{name} on the device thread: {session}"
