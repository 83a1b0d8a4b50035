"""An FX module global that every thread used to share, now per-thread (patch 0003), shown with threads.

``torch.fx._lazy_graph_module._use_lazy_graph_module_flag`` is a module global that every dynamo
compile sets: ``torch.fx.symbolic_trace`` in thread B during thread A's compile returns a
``_LazyGraphModule``, which ``torch.jit.script`` rejects.

Events fix the interleaving. Plain torch (``DFLASH_PATCHES=0``) must fail the scenario, the
series must pass it. Integration tier: two fresh interpreters (about 10-30 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

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


def test_symbolic_trace_during_another_threads_compile_gives_a_scriptable_graph_module():
    plain = _run(LAZY_GRAPH_MODULE, False)
    assert plain != "scripted", "plain torch scripted the graph module: the race did not show"
    patched = _run(LAZY_GRAPH_MODULE, True)
    assert patched == "scripted", f"another thread's compile made symbolic_trace lazy: {patched}"
