"""What the bug-class checks race: compiled functions, FX traces and flag polls, each a *step*.

A step is a zero-argument callable returning None when all was right or a one-line description
of what went wrong (an exception raised by a step is a failure too); :mod:`.checks` runs two of
them on two threads at once. The stress suite (``stress/``) reuses the compiled workloads.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator

import torch

from dflash.compile_watch import CountingBackend, fresh_function

#: The backend of the warm compiled functions: eager graphs whose runs are counted per thread,
#: so a call that silently fell back to eager shows.
COUNTING = CountingBackend("eager")


def install_fake_cuda_device_guard() -> None:
    """Do first what a process's first ``FakeTensorMode.__enter__`` does on a host without a GPU
    (install a no-op CUDA device guard). On the 2.10 and 2.11 CUDA wheels, doing it in one thread
    while another runs tensor ops crashes the process, plain and patched (docs/patch-series.md,
    "Known gaps"); it imports nothing, so what races afterwards is what a check means to race."""
    if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        torch._C._ensureCUDADeviceGuardSet()


def compiled_call(fn: Callable, *args) -> tuple[object, bool]:
    """Call a function compiled with :data:`COUNTING`; returns (output, whether a compiled graph ran)."""
    before = COUNTING.runs()
    out = fn(*args)
    return out, COUNTING.runs() > before


def sin_plus_one(x):
    """The compiled workload: ``sin(x) + 1``, any shape and floating dtype."""
    return torch.sin(x) + 1


def sin_with_graph_break(x):
    """``sin(x) + 1`` with a ``torch._dynamo.graph_break()`` between the two ops."""
    y = torch.sin(x)
    torch._dynamo.graph_break()
    return y + 1


def traced_net():
    """A small module with one submodule, the target of the FX traces below."""

    class TracedNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    return TracedNet()


def symbolic_trace_step(net) -> Callable[[], str | None]:
    """One torch.fx.symbolic_trace of ``net``; a failure if any module but ``net.lin`` was captured."""

    def step() -> str | None:
        gm = torch.fx.symbolic_trace(net)
        called = [node.target for node in gm.graph.nodes if node.op == "call_module"]
        return None if called == ["lin"] else f"symbolic_trace captured call_module targets {called}, expected ['lin']"

    return step


def warm_compiled_call_step(warm: Callable, x) -> Callable[[], str | None]:
    """Call the warm compiled ``warm``; a failure if it raised, ran eagerly or computed a wrong value."""
    expected = sin_plus_one(x)

    def step() -> str | None:
        out, ran_graph = compiled_call(warm, x)
        if not ran_graph:
            return "warm compiled function ran eagerly (its compiled graph did not run)"
        return None if torch.equal(out, expected) else "warm compiled function returned a wrong value"

    return step


def compile_new_functions_step(backend: str) -> Callable[[], str | None]:
    """Compile and call a fresh function each step (AOT backends trace with make_fx, i.e. FX)."""
    counter = iter(range(1 << 62))
    x = torch.randn(8)

    def step() -> str | None:
        fn = torch.compile(fresh_function(sin_plus_one, next(counter)), backend=backend)
        return None if torch.allclose(fn(x), sin_plus_one(x)) else "fresh compiled function returned a wrong value"

    return step


def warm_compiled_function():
    warm = torch.compile(sin_plus_one, backend=COUNTING)
    x = torch.randn(8)
    _, ran_graph = compiled_call(warm, x)
    if not ran_graph:
        raise RuntimeError("warm-up: the compiled function did not run its graph before any race started")
    return warm, x


#: ``torch.compiler.is_exporting``, None before torch 2.7 (there export sets only ``is_compiling()``,
#: which the polls read too).
IS_EXPORTING: Callable[[], bool] | None = getattr(torch.compiler, "is_exporting", None)


def poll_session_flags_step(check_compile_handoff: bool) -> Callable[[], str | None]:
    """Poll the session flags from an eager thread; optionally check torch.compile wraps a function."""

    def plain(x):
        return x + 1

    def step() -> str | None:
        # Most specific symptom first: export also sets is_compiling.
        if check_compile_handoff and torch.compile(plain, backend="eager") is plain:
            return "torch.compile() handed back the uncompiled function (another thread is exporting)"
        if IS_EXPORTING is not None and IS_EXPORTING():
            return "torch.compiler.is_exporting() is True in an eager thread"
        if torch.compiler.is_compiling():
            return "torch.compiler.is_compiling() is True in an eager thread"
        return None

    return step


@contextlib.contextmanager
def node_meta_of(owner: str) -> Iterator[None]:
    """Node metadata saying ``owner`` for what this thread traces meanwhile: a stack trace, and
    an ``annotate`` tag where torch has it (2.10+), inside ``preserve_node_meta`` as AOTAutograd's
    joint trace and export record theirs (``torch/fx/traceback.py``, class I)."""
    import torch.fx.traceback as fx_traceback

    with contextlib.ExitStack() as stack:
        stack.enter_context(fx_traceback.preserve_node_meta())
        fx_traceback.set_stack_trace([f'File "{owner}"\n'])
        if hasattr(fx_traceback, "annotate"):
            stack.enter_context(fx_traceback.annotate({"owner": owner}))
        yield


def node_meta_owners(gm: torch.fx.GraphModule) -> set[tuple[str | None, str | None]]:
    """(stack trace, annotated owner) of each call node of ``gm``."""
    return {
        (node.meta.get("stack_trace"), (node.meta.get("custom") or {}).get("owner"))
        for node in gm.graph.nodes
        if node.op == "call_function"
    }


def trace_with_own_node_meta_step(owner: str) -> Callable[[], str | None]:
    """make_fx of :func:`sin_plus_one` under ``node_meta_of(owner)``; a failure unless every node
    carries exactly that metadata (another thread's stack trace or tag leaked in)."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(8)
    expected = {(f'File "{owner}"\n', owner if hasattr(fx_traceback, "annotate") else None)}

    def step() -> str | None:
        with node_meta_of(owner):
            gm = make_fx(sin_plus_one)(x)
        seen = node_meta_owners(gm)
        return None if seen == expected else f"nodes traced by {owner} carry (stack trace, tag) {sorted(seen, key=str)}"

    return step


def hold_node_meta_step(owner: str) -> Callable[[], str | None]:
    """Hold ``node_meta_of(owner)`` open briefly, tracing nothing."""

    def step() -> str | None:
        with node_meta_of(owner):
            time.sleep(0.001)
        return None

    return step


def export_load_step() -> Callable[[], str | None]:
    """torch.export.load of a saved program, then a call of it; a failure if it computes a wrong value
    (the deserializer of ``torch/_export/serde/serialize.py``, class J, pytorch issue 195099)."""
    net, x = traced_net(), torch.randn(2, 4)
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(net, (x,)), buffer)
    saved = buffer.getvalue()
    with torch.no_grad():
        expected = net(x)

    def step() -> str | None:
        loaded = torch.export.load(io.BytesIO(saved)).module()
        with torch.no_grad():
            out = loaded(x)
        return None if torch.allclose(out, expected) else "a loaded ExportedProgram computed a wrong value"

    return step


def export_save_step() -> Callable[[], str | None]:
    """``serialize_torch_artifact`` (what ``torch.export.save`` pickles an ExportedProgram's state dict
    and constants with) of a dict of tensors, read back; a failure if it raises or reads back a wrong
    value. Plain torch registers its FakeTensor reducer in the process-wide ``copyreg.dispatch_table``
    for the length of the save and deletes it afterwards (class J; pytorch PR 195100 fixes the load half
    only, no upstream issue names this one)."""
    from torch._export.serde.serialize import deserialize_torch_artifact, serialize_torch_artifact

    artifact = {"w": torch.randn(16, 16), "b": torch.randn(16)}

    def step() -> str | None:
        back = deserialize_torch_artifact(serialize_torch_artifact(artifact))
        same = back.keys() == artifact.keys() and all(torch.equal(back[k], artifact[k]) for k in artifact)
        return None if same else "serialize_torch_artifact read back a wrong value"

    return step


def export_step() -> Callable[[], str | None]:
    """``torch.export.export`` of a small module (pre-dispatch tracing: its proxy mode sits on the
    pre-dispatch mode stack), checked against eager."""

    class Exported(torch.nn.Module):
        def forward(self, x):
            return torch.sin(x) + 1

    x = torch.randn(8)

    def step() -> str | None:
        program = torch.export.export(Exported(), (x,))
        return None if torch.allclose(program.module()(x), sin_plus_one(x)) else "exported program gave a wrong value"

    return step


def make_fx_of_cond_step() -> Callable[[], str | None]:
    """``make_fx`` of a function calling ``torch.cond``, a higher-order op whose branches re-enter
    the open make_fx trace (``reenter_make_fx``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def branches(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    x = torch.randn(8)

    def step() -> str | None:
        gm = make_fx(branches)(x)
        return None if torch.allclose(gm(x), branches(x)) else "make_fx of torch.cond traced a wrong graph"

    return step


class SharedModule(torch.nn.Module):
    """Linear + relu + sum: the compiled module that threads share in :func:`shared_module_step`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)).sum()


def shared_module_step(compiled: torch.nn.Module, eager: torch.nn.Module, seed: int) -> Callable[[], str | None]:
    """Forward and backward of one ``torch.compile(module, dynamic=True)`` that several threads call
    with inputs whose rank and sizes change, so one thread's recompile (an AOTAutograd joint trace)
    overlaps other threads' calls; the output and the input's gradient are checked against
    ``eager`` (the same module)."""
    import random

    rng = random.Random(seed)

    def step() -> str | None:
        shape = [rng.randint(1, 4) for _ in range(rng.randint(0, 3))] + [8]
        x = torch.randn(*shape, requires_grad=True)
        out = compiled(x)
        (grad,) = torch.autograd.grad(out, x)
        x_eager = x.detach().requires_grad_()
        expected = eager(x_eager)
        (expected_grad,) = torch.autograd.grad(expected, x_eager)
        if not torch.allclose(out, expected, atol=1e-4) or not torch.allclose(grad, expected_grad, atol=1e-5):
            return f"compiled shared module gave a wrong value or gradient for shape {shape}"
        return None

    return step
