"""A thread inside a compiled call that waits for another thread's compiled call (patch 0007).

``_SharedEvalFrameSettings`` (torch/_dynamo/eval_frame.py, patched, torch 2.6-2.14) makes a thread
that needs other eval-frame values (an ``isolate_recompiles=True`` function, a
``skip_guard_eval_unsafe`` stance) wait until no other thread is inside a compiled call. When the
thread inside its call is itself waiting for the changer (a handoff between pipeline threads, a
collective, an event set after the other thread's step), neither can go on: plain torch runs both
calls at once. Here thread A's compiled function waits (in a ``torch._dynamo.disable``d helper) for
an event that the main thread sets after calling an ``isolate_recompiles=True`` function; A gives
up after ``WAIT_S`` seconds, so a deadlock shows as a slow call and A's ``TimeoutError``. The gate
waits at most ``_GATE_TIMEOUT_S`` (2 s), then warns and sets the values as plain torch does.

Integration tier: two fresh interpreters (about 10-40 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

eval_frame = pytest.importorskip("torch._dynamo.eval_frame")
requires_isolate_recompiles = pytest.mark.skipif(
    not hasattr(eval_frame, "get_eval_frame_isolate_recompiles_id"), reason="needs isolate_recompiles (torch >= 2.13)"
)

WAIT_S = 8.0

SCRIPT = f"""
import json, threading, time, warnings
import torch

released = threading.Event()


@torch._dynamo.disable
def wait_for_main():
    if not released.wait({WAIT_S}):
        raise TimeoutError("the main thread never released thread A")


@torch.compile(backend="eager")
def waits(x):
    x = x + 1
    wait_for_main()
    return x * 2


@torch.compile(backend="eager", isolate_recompiles=True)
def isolated(x):
    return x - 1


x = torch.ones(2)
released.set()
waits(x)
isolated(x)  # both compiled: the calls below are warm
released.clear()
errors = []


def thread_a():
    try:
        waits(x)
    except Exception as e:
        errors.append(repr(e))


a = threading.Thread(target=thread_a, daemon=True)
a.start()
time.sleep(0.5)  # A is inside its compiled call, waiting
start = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    isolated(x)
seconds = time.monotonic() - start
released.set()
a.join(30)
print(json.dumps({{"seconds": seconds, "errors": errors, "warnings": [str(w.message) for w in caught]}}))
"""


def _run(patched: bool) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires_isolate_recompiles
def test_a_call_needing_other_values_does_not_wait_for_a_call_that_waits_for_it():
    plain = _run(False)
    # Plain torch runs both calls at once: the handoff completes at once.
    assert plain["errors"] == [] and plain["seconds"] < WAIT_S / 2, f"plain torch did not complete the handoff: {plain}"
    patched = _run(True)
    assert patched["errors"] == [] and patched["seconds"] < WAIT_S / 2, (
        f"the isolate_recompiles call waited for thread A's compiled call, which waited for it: {patched}"
    )
    # It waited its bound for A and then said that it went ahead.
    assert any("eval-frame settings" in w for w in patched["warnings"]), patched
