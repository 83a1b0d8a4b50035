"""The compile-wrapper-guard patch's shared eval-frame gate, through real compiled calls.

``_SharedEvalFrameSettings`` (torch/_dynamo/eval_frame.py, patched; its common case is inlined
into compile_wrapper) keeps C-global eval-frame settings consistent for the threads inside
compiled calls: every thread inside a call sees the values it entered with, a thread needing
other values waits, and nested changes (a compiled call inside another one, with other values)
neither deadlock nor leave another thread under the wrong values. ``eval_frame_probe.py`` checks
it from inside real compiled calls, plain torch first (the race must show there).

From torch 2.15 the settings are per-thread in C: there is no race to show and no gate (the
2.15 variant keeps only error_on_graph_break per-thread); a thread's next call must still run
under its own values after another thread's calls changed theirs, on every release.
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
requires_isolate_recompiles = pytest.mark.skipif(
    not hasattr(eval_frame, "get_eval_frame_isolate_recompiles_id"), reason="needs isolate_recompiles (torch >= 2.13)"
)

PROBE = Path(__file__).with_name("eval_frame_probe.py")


def _read_eval_frame_values() -> tuple[bool, int]:
    """(skip_guard_eval_unsafe, isolate-recompiles id) the calling thread's eval frame holds now."""
    from torch._C._dynamo.eval_frame import get_eval_frame_isolate_recompiles_id, set_skip_guard_eval_unsafe

    skip = set_skip_guard_eval_unsafe(False)  # the only reader C offers is the setter's return value
    set_skip_guard_eval_unsafe(skip)
    return skip, get_eval_frame_isolate_recompiles_id()


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the thread did not finish"
    return out[0]


def _settings_are_per_thread() -> bool:
    """Whether this torch keeps the eval-frame settings per thread in C (2.15 and later)."""
    from torch._C._dynamo.eval_frame import set_eval_frame_isolate_recompiles_id

    prior = set_eval_frame_isolate_recompiles_id(7)
    try:
        return _in_thread(_read_eval_frame_values)[1] != 7
    finally:
        set_eval_frame_isolate_recompiles_id(prior)


def _probe(patched: bool, seconds: float) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    done = subprocess.run(
        [sys.executable, str(PROBE), str(seconds)], env=env, capture_output=True, text=True, timeout=seconds + 240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires_isolate_recompiles
def test_threads_inside_real_compiled_calls_keep_their_eval_frame_values():
    if _settings_are_per_thread():
        pytest.skip("this torch keeps the eval-frame settings per thread in C: no shared values to race on")
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


@requires_isolate_recompiles
def test_a_threads_next_call_runs_under_its_own_values_after_another_thread_changed_them():
    """Thread A calls under other values (an isolate_recompiles=True function; a skip_guard_eval_unsafe
    stance), thread B then makes a default call, then A makes a default call: A's must run under the
    default values. With per-thread C settings (2.15+) a process-wide record of "the values in force"
    is wrong: A would skip setting values its own thread state does not hold (guards stay skipped)."""
    torch = pytest.importorskip("torch")
    seen = {}

    @torch._dynamo.disable
    def look(tag):
        seen[tag] = _read_eval_frame_values()

    def body(x, tag):
        y = x.sin()
        look(tag)
        return y + 1

    default = torch.compile(body, backend="eager")
    isolated = torch.compile(body, backend="eager", isolate_recompiles=True)
    x = torch.randn(4)
    default(x, "warm")
    isolated(x, "warm")

    def a_other_values_then_default(first) -> None:
        first()
        _in_thread(lambda: default(x, "B default"))
        default(x, "A default")

    _in_thread(lambda: a_other_values_then_default(lambda: isolated(x, "A isolated")))
    assert seen["A isolated"] == (False, isolated._isolate_recompiles_id), seen
    assert seen["A default"] == (False, -1), f"A's default call ran under its earlier isolated call's id: {seen}"

    def under_skip_guard_stance():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            default(x, "A skip-guard stance")

    _in_thread(lambda: a_other_values_then_default(under_skip_guard_stance))
    assert seen["A skip-guard stance"][0] is True, seen
    assert seen["A default"] == (False, -1), f"A's default call still skipped guards: {seen}"
