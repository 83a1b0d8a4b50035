"""FX module globals that every thread used to share, now per-thread (patch 0003), shown with threads.

- ``torch.fx.experimental.proxy_tensor._CURRENT_MAKE_FX_TRACER`` is a module global set by every
  ``make_fx`` (AOTAutograd inside a compile, non-strict export): a higher-order op (``torch.cond``,
  flex_attention, ...) traced in thread B while thread A is inside its own ``make_fx`` has its
  branches traced by A's tracer (``AssertionError: Mixing fake modes NYI``).
- ``torch.fx._lazy_graph_module._use_lazy_graph_module_flag`` is a module global that every dynamo
  compile sets: ``torch.fx.symbolic_trace`` in thread B during thread A's compile returns a
  ``_LazyGraphModule``, which ``torch.jit.script`` rejects.

Events fix the interleaving. Plain torch (``DFLASH_PATCHES=0``) must fail each scenario, the
series must pass it. Integration tier: four fresh interpreters (about 20-60 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

MAKE_FX_HOP = """
import json, threading
import torch
from torch.fx.experimental.proxy_tensor import make_fx

b_inside, a_inside, b_done = threading.Event(), threading.Event(), threading.Event()
results = {}


def traced_by_a(x):
    y = x + 1
    a_inside.set()
    b_done.wait(30)
    return y * 3


def traced_by_b(x):
    b_inside.set()
    a_inside.wait(30)  # B's cond below is traced while A is inside its make_fx
    try:
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))
    finally:
        b_done.set()


def run(name, fn):
    try:
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(3))
        results[name] = sorted(n for n, _ in gm.named_children())
    except Exception as e:
        results[name] = repr(e)[:300]


make_fx(lambda x: torch.cond(x.sum() > 0, torch.sin, torch.cos, (x,)), tracing_mode="fake")(torch.randn(3))
b = threading.Thread(target=run, args=("b", traced_by_b))
a = threading.Thread(target=run, args=("a", traced_by_a))
b.start()
b_inside.wait(30)
a.start()
a.join(60)
b.join(60)
print(json.dumps(results))
"""

LAZY_GRAPH_MODULE = """
import json, threading
import torch, torch.fx

inside, release = threading.Event(), threading.Event()


def holding_backend(gm, example_inputs):
    inside.set()
    release.wait(30)  # thread A's compile stays open
    return gm.forward


@torch.compile(backend=holding_backend)
def compiled(x):
    return x + 1


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


torch.jit.script(torch.fx.symbolic_trace(Double()))
a = threading.Thread(target=lambda: compiled(torch.ones(2)), daemon=True)
a.start()
inside.wait(60)
try:
    torch.jit.script(torch.fx.symbolic_trace(Double()))
    result = "scripted"
except Exception as e:
    result = repr(e)[:300]
release.set()
a.join(60)
print(json.dumps(result))
"""


def _run(script: str, patched: bool):
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


EXPECTED_MAKE_FX = {"a": [], "b": ["false_graph_0", "true_graph_0"]}


def test_a_higher_order_op_is_traced_by_its_own_threads_make_fx():
    plain = _run(MAKE_FX_HOP, False)
    assert plain != EXPECTED_MAKE_FX, f"plain torch traced both graphs right: the race did not show: {plain}"
    patched = _run(MAKE_FX_HOP, True)
    assert patched == EXPECTED_MAKE_FX, f"a make_fx trace used another thread's tracer: {patched}"


def test_symbolic_trace_during_another_threads_compile_gives_a_scriptable_graph_module():
    plain = _run(LAZY_GRAPH_MODULE, False)
    assert plain != "scripted", "plain torch scripted the graph module: the race did not show"
    patched = _run(LAZY_GRAPH_MODULE, True)
    assert patched == "scripted", f"another thread's compile made symbolic_trace lazy: {patched}"
