"""What a thread's compiled call computes after another thread's change outlasted the gate's bound (patch 0007).

``_SharedEvalFrameSettings._hold`` (torch/_dynamo/eval_frame.py, patched) waits at most
``_GATE_TIMEOUT_S`` (2 s) for other threads' compiled calls to end, then sets the values it needs
while they still run, and (outside compiled calls "the last ones stay set") leaves them set after
its own call ends. Here thread A's compiled call is inside a 3.5 s eager section (a
``torch._dynamo.disable``d sleep: any step longer than 2 s, a first-call compile included) when the
main thread runs a call under ``set_stance(skip_guard_eval_unsafe=True)``. Plain torch sets the
value for the main thread's short call and restores it at its end, so A's resumed frame still
evaluates its guards and sees the changed global (SCALE=2). The series leaves
``skip_guard_eval_unsafe`` set after the main thread's call, and A's resumed frame runs the graph
compiled for SCALE=1 without checking its guards: a wrong result where plain torch computes the
right one, and where the series before the 2 s bound waited and computed it too.

Integration tier: two fresh interpreters (about 15-40 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch._dynamo.eval_frame")

SCRIPT = """
import json, threading, time, warnings
import torch

SCALE = 1.0
a_sleeps = threading.Event()


@torch._dynamo.disable
def long_eager_section():
    if a_sleeps.is_set():
        time.sleep(3.5)


@torch.compile(backend="eager")
def a_fn(x):
    y = x + 1
    long_eager_section()
    return y * SCALE


@torch.compile(backend="eager")
def b_fn(x):
    return x - 1


x = torch.ones(2)
a_fn(x)
b_fn(x)
with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
    b_fn(x)  # warm: the call below compiles nothing
SCALE = 2.0  # A's resumed frame must recompile (guard on SCALE) or compute with 2.0
out = {}


def thread_a():
    out["a"] = a_fn(x).tolist()


a_sleeps.set()
a = threading.Thread(target=thread_a)
a.start()
time.sleep(0.5)  # A is inside its compiled call
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        b_fn(x)
a.join(60)
out["expected"] = ((x + 1) * SCALE).tolist()
print(json.dumps(out))
"""


def _run(patched: bool) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_change_past_the_gate_bound_does_not_outlive_the_changers_call():
    plain = _run(False)
    assert plain["a"] == plain["expected"], f"plain torch computed a wrong result: {plain}"
    patched = _run(True)
    assert patched["a"] == patched["expected"], (
        "thread A's resumed frame ran with skip_guard_eval_unsafe=True left set by the main thread's "
        f"finished call (its SCALE=1 graph, guards unchecked): {patched}"
    )
