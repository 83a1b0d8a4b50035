"""Patch 0013: AOTAutograd traces without anomaly mode, a flag for the whole process that made every
other thread's autograd nodes take the GIL under a leaf's mutex (the hang of threads sharing one
compiled module, docs/bug-classes.md); the backward graphs keep the forward stack traces anomaly
mode gave them, and an error raised while a backward is traced still warns with the forward call that
caused it. Fresh interpreters, plain vs patched."""

from __future__ import annotations

import pytest
from tiny import script_result

torch = pytest.importorskip("torch")

#: A thread compiles new functions (AOT backend: joint traces) while another polls the flag.
FLAG_SEEN_ELSEWHERE = r"""
import itertools, json, threading, time
import torch
counter = itertools.count()
def compile_new():
    n = next(counter)
    fn = eval(f"lambda x: torch.sin(x) * {n}", {"torch": torch})
    torch.compile(fn, backend="aot_eager")(torch.randn(4, requires_grad=True)).sum().backward()
compile_new()
seen, stop = [], time.monotonic() + 4
def poll():
    while time.monotonic() < stop:
        seen.append(torch.is_anomaly_enabled())
threads = [threading.Thread(target=poll)]
threads[0].start()
while time.monotonic() < stop:
    compile_new()
threads[0].join()
print(json.dumps({"polls": len(seen), "on": sum(seen)}))
"""

#: A module in a file of its own: its stack traces have source lines (``python -c``'s have none).
MODEL = """
import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return (y * y.sin()).sum()
"""

#: Every backward graph node's stack trace of that module, compiled.
BACKWARD_STACKS = r"""
import json, sys, torch
from torch._functorch.aot_autograd import aot_module_simplified
sys.path.insert(0, {directory!r})
from model_for_stacks import M
graphs = []
def grab(gm, _):
    graphs.append([[n.name, n.meta.get("stack_trace")] for n in gm.graph.nodes if n.op == "call_function"])
    return gm
def backend(gm, inputs):
    return aot_module_simplified(gm, inputs, fw_compiler=grab, bw_compiler=grab)
torch.compile(M(), backend=backend)(torch.randn(3, 4, requires_grad=True)).backward()
print(json.dumps(graphs))
"""

#: Backwards that raise while AOTAutograd traces them (``allow_in_graph``: the hooks and the
#: function are traced by AOTAutograd, not dynamo), each compiled on a line of its own.
FAILING_BACKWARDS = """
import torch
from torch._dynamo import allow_in_graph


def fail(*_):
    raise AssertionError("fail")


class Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        fail()


@allow_in_graph
def hook_on_the_root(x):  # PyTorch's test_anomaly_aot_autograd
    r = x.sum()
    r.register_hook(fail)
    return r


@allow_in_graph
def a_function_backward(x):  # the node's own backward raises
    return (Fail.apply(x.sin()) * 2).sum()


@allow_in_graph
def hook_on_the_first_branch(x):  # the engine runs cos's node first, then sin's
    a, b = x.sin(), x.cos()
    a.register_hook(fail)
    return (a * b).sum()


@allow_in_graph
def hook_on_the_second_branch(x):
    a, b = x.sin(), x.cos()
    b.register_hook(fail)
    return (a * b).sum()


CASES = {
    "hook_on_the_root": lambda x: hook_on_the_root(x) + 1,
    "a_function_backward": lambda x: a_function_backward(x) + 1,
    "hook_on_the_first_branch": lambda x: hook_on_the_first_branch(x) + 1,
    "hook_on_the_second_branch": lambda x: hook_on_the_second_branch(x) + 1,
}
"""

#: What each case raises and the warnings it gives (without the C++ warning's "Triggered internally" tail).
FORWARD_CALL_WARNINGS = r"""
import json, sys, warnings, torch
sys.path.insert(0, {directory!r})
from failing_backwards import CASES
results = {{}}
for name, fn in CASES.items():
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.compile(fn, backend="aot_eager")(torch.randn(2, 2, requires_grad=True))
            raised = None
        except torch._dynamo.exc.BackendCompilerFailed as error:
            raised = repr(error.inner_exception)
    messages = [str(w.message).split(" (Triggered internally")[0] for w in caught]
    results[name] = {{"raised": raised, "last warning": messages[-1] if messages else None}}
print(json.dumps(results))
"""


def test_a_compile_turns_anomaly_mode_on_for_every_thread_on_plain_torch_only():
    plain = script_result(FLAG_SEEN_ELSEWHERE, patched=False)
    patched = script_result(FLAG_SEEN_ELSEWHERE, patched=True)
    assert plain["on"] > 0, plain  # the flag the other thread's compiles turned on
    assert patched["polls"] > 0 and patched["on"] == 0, patched


def test_backward_graphs_keep_the_forward_stack_traces(tmp_path):
    (tmp_path / "model_for_stacks.py").write_text(MODEL)
    script = BACKWARD_STACKS.format(directory=str(tmp_path))
    plain = script_result(script, patched=False)
    patched = script_result(script, patched=True)
    backward = plain[1]
    assert backward and all(stack for _, stack in backward), backward  # anomaly mode gave each one a stack
    assert patched == plain


def test_an_error_in_a_traced_backward_warns_with_the_forward_call_that_caused_it(tmp_path):
    (tmp_path / "failing_backwards.py").write_text(FAILING_BACKWARDS)
    script = FORWARD_CALL_WARNINGS.format(directory=str(tmp_path))
    plain = script_result(script, patched=False)
    patched = script_result(script, patched=True)
    failing_nodes = {
        "hook_on_the_root": "SumBackward0",
        "a_function_backward": "FailBackward",
        "hook_on_the_first_branch": "SinBackward0",
        "hook_on_the_second_branch": "CosBackward0",
    }
    for case, node in failing_nodes.items():
        assert plain[case]["raised"] == "AssertionError('fail')", plain
        # anomaly mode's warning, naming the node and the line of the case's compiled lambda
        warning = plain[case]["last warning"]
        assert warning.startswith(f"Error detected in {node}. Traceback of forward call that caused the error:\n")
        assert f'"{case}": lambda x: {case}(x) + 1' in warning, warning
    assert patched == plain
