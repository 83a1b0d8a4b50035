"""The compile-wrapper-guard patch's shared eval-frame gate, through real compiled calls.

``_SharedEvalFrameSettings`` (torch/_dynamo/eval_frame.py, patched; its common case is inlined
into compile_wrapper) keeps C-global eval-frame settings consistent for the threads inside
compiled calls: every thread inside a call sees the values it entered with, a thread needing
other values waits, and nested changes (a compiled call inside another one, with other values)
neither deadlock nor leave another thread under the wrong values. ``eval_frame_probe.py`` checks
it from inside real compiled calls, plain torch first (the race must show there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash.patchtools.verify.runner import rerun_while_passing

eval_frame = pytest.importorskip("torch._dynamo.eval_frame")
Gate = getattr(eval_frame, "_SharedEvalFrameSettings", None)
requires_gate = pytest.mark.skipif(Gate is None, reason="compile-wrapper-guard is not applied in this interpreter")

PROBE = Path(__file__).with_name("eval_frame_probe.py")


def _probe(patched: bool, seconds: float) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    done = subprocess.run(
        [sys.executable, str(PROBE), str(seconds)], env=env, capture_output=True, text=True, timeout=seconds + 240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_threads_inside_real_compiled_calls_keep_their_eval_frame_values():
    # Plain torch first: the probe must see the race there, or it has lost its teeth.
    plain = rerun_while_passing(
        _probe(False, 1.0), lambda scale: _probe(False, scale * 1.0), lambda r: r["violations"] > 0, attempts=2
    )
    assert plain["violations"] > 0, f"plain torch showed no race: {plain}"
    if Gate is None:
        pytest.skip("compile-wrapper-guard is not applied in this interpreter")
    patched = _probe(True, 2.0)
    assert patched["stuck"] == 0, f"compiled calls deadlocked: {patched}"
    assert patched["nested"] > 0 and patched["calls"] > 100, patched
    assert patched["violations"] == 0, f"calls ran under another call's values: {patched}"


@requires_gate
def test_steady_compiled_calls_take_no_lock(monkeypatch):
    torch = pytest.importorskip("torch")
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    x = torch.ones(2)
    compiled(x)  # compiles and sets the values
    entered, enter = [], Gate.enter

    def counting_enter(self, depth, value) -> None:
        entered.append(value)
        enter(self, depth, value)

    monkeypatch.setattr(Gate, "enter", counting_enter)

    def run() -> None:
        for _ in range(500):
            compiled(x)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not entered, f"{len(entered)} of 2000 steady compiled calls took the gate's lock"


@requires_gate
def test_a_call_that_raises_before_its_try_is_uncounted(monkeypatch):
    """compile_wrapper counts the call before it installs the eval-frame callback; if that raises,
    the count must still drop, or every later change of the values waits forever."""
    torch = pytest.importorskip("torch")
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    compiled(torch.ones(2))
    depth = eval_frame._eval_frame_settings.calls.depth

    def broken_callback_from_stance(callback):
        raise RuntimeError("callback lookup failed")

    monkeypatch.setattr(eval_frame, "_callback_from_stance", broken_callback_from_stance)
    with pytest.raises(RuntimeError, match="callback lookup failed"):
        compiled(torch.ones(2))
    assert depth.n == 0
