"""Patch 0013: AOTAutograd traces without anomaly mode, a flag for the whole process that made every
other thread's autograd nodes take the GIL under a leaf's mutex (the hang of threads sharing one
compiled module, docs/bug-classes.md); the backward graphs keep the forward stack traces anomaly
mode gave them. Fresh interpreters, plain vs patched."""

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
