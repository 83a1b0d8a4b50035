"""The first torch.compile() and torch.export.export() calls take dynamo's compile lock; later ones do not (patch 0010).

Class K (``docs/bug-classes.md``): started together in threads of a fresh process, the first calls
import torch._dynamo, torch._inductor and torch._export along import cycles and fail on
half-imported modules; ``dflash patches verify K`` shows that on plain torch. Here, in a fresh
patched interpreter, the main thread holds ``torch._utils._compile_lock`` while another thread makes a
call: a cold call must not get as far as its imports (the module it would import stays absent), a
warm one and a compiled call must return meanwhile (nothing more on their path).

Integration tier: fresh interpreters.
"""

from __future__ import annotations

import pytest
from tiny import script_result

pytest.importorskip("torch")

WHILE_LOCK_HELD = """
import json, sys, threading
import torch


def while_lock_held(call, wrapped=None):
    # While this thread holds the lock: did `call` return within 10 s, and did it enter `wrapped`
    # (the function torch's wrapper wraps), in another thread?
    returned, entered = threading.Event(), threading.Event()
    code = wrapped.__code__ if wrapped is not None else None

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is code:
            entered.set()

    def run():
        if code is not None:  # not around a compiled call: dynamo's frame hook would see the profiler
            sys.setprofile(watch)
        call()
        sys.setprofile(None)
        returned.set()

    thread = threading.Thread(target=run, daemon=True)
    with torch._utils._compile_lock:
        thread.start()
        seen = (returned.wait(10), entered.is_set() or code is None)
    thread.join(300)
    assert returned.is_set(), "the call did not return after the lock was released"
    return seen


class Exported(torch.nn.Module):
    def forward(self, x):
        return x + 1


x = torch.ones(2)
compile_body, export_body = torch.compile.__wrapped__, torch.export.export.__wrapped__
out = {}
out["a decorator-mode compile() waits"] = while_lock_held(
    lambda: torch.compile(backend="eager"), compile_body
) == (False, False)
out["it imports nothing, so the next compile() is cold too"] = "torch._dynamo" not in sys.modules
out["the first compile() waits before its body"] = while_lock_held(
    lambda: torch.compile(lambda t: t * 2, backend="eager"), compile_body
) == (False, False)
out["a later compile() runs"] = while_lock_held(
    lambda: torch.compile(lambda t: t, backend="eager"), compile_body
) == (True, True)
compiled = torch.compile(lambda t: t - 1, backend="eager")
compiled(x)
out["a compiled call runs"] = while_lock_held(lambda: compiled(x)) == (True, True)
out["the first export waits before its body"] = while_lock_held(
    lambda: torch.export.export(Exported(), (x,)), export_body
) == (False, False)
out["a later export runs"] = while_lock_held(lambda: torch.export.export(Exported(), (x,)), export_body) == (True, True)
out["dynamo compiles under the same lock"] = torch._dynamo.convert_frame.compile_lock is torch._utils._compile_lock
print(json.dumps(out))
"""


def test_only_cold_calls_take_the_compile_lock():
    patched = script_result(WHILE_LOCK_HELD, patched=True, timeout_s=900)
    assert all(patched.values()), patched
