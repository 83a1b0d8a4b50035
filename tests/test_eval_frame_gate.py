"""The compile-wrapper-guard patch's shared eval-frame gate, driven directly by many threads.

``_SharedEvalFrameSettings`` (torch/_dynamo/eval_frame.py, patched) keeps C-global eval-frame
settings consistent for the threads inside compiled calls: every thread inside a call must see
the values it entered with, a thread needing other values waits, and nested changes (a
compiled call inside another one, with other values) must neither deadlock nor leave another
thread under the wrong values. Here the C globals are a Python variable, so a violation is
seen the moment it happens. compile_wrapper inlines the gate's lock-free common case;
``_enter``/``_exit`` below are those same lines.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

eval_frame = pytest.importorskip("torch._dynamo.eval_frame")
Gate = getattr(eval_frame, "_SharedEvalFrameSettings", None)
pytestmark = pytest.mark.skipif(Gate is None, reason="compile-wrapper-guard is not applied in this interpreter")

VALUES = ((False, -1), (True, -1), (False, 7))


class _CGlobals:
    def __init__(self) -> None:
        self.value = None
        self.applied = 0

    def apply(self, value) -> None:
        self.value = value
        self.applied += 1


def _enter(gate: Gate, value):
    depth = gate.calls.depth
    depth.n += 1
    locked = not eval_frame._GIL_ENABLED or gate.changers or value != gate.value
    if locked:
        gate.enter(depth, value)
    return depth, locked


def _exit(gate: Gate, depth, locked) -> None:
    if locked:
        gate.exit(depth)
    else:
        depth.n -= 1
        if gate.changers:
            gate.notify()


def _call(gate: Gate, globals_: _CGlobals, value, depth: int, rng: random.Random, violations: list) -> None:
    token = _enter(gate, value)
    try:
        for _ in range(rng.randrange(1, 4)):
            if globals_.value != value:
                violations.append((threading.get_ident(), value, globals_.value))
            time.sleep(rng.random() * 1e-4)  # let other threads in while this one is inside
            if depth < 3 and rng.random() < 0.3:
                nested = value if rng.random() < 0.6 else rng.choice(VALUES)
                _call(gate, globals_, nested, depth + 1, rng, violations)
                if globals_.value != value:  # back in the outer call: its values again
                    violations.append((threading.get_ident(), value, globals_.value))
    finally:
        _exit(gate, *token)


@pytest.mark.parametrize("seed", range(4))
def test_every_thread_inside_a_call_sees_its_values(seed):
    globals_, violations = _CGlobals(), []
    gate = Gate(globals_.apply)
    deadline = time.monotonic() + 1.0

    def run(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        while time.monotonic() < deadline:
            # Mostly the common value, as in a training loop; sometimes a stance-like change.
            _call(gate, globals_, VALUES[0] if rng.random() < 0.8 else rng.choice(VALUES), 0, rng, violations)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not [t.name for t in threads if t.is_alive()], "gate deadlocked"
    assert not violations, f"{len(violations)} calls ran under other values, first: {violations[0]}"
    assert globals_.applied > 1  # the values did change during the run: the waits were exercised


def test_steady_calls_take_no_lock_and_apply_the_values_once(monkeypatch):
    globals_ = _CGlobals()
    gate = Gate(globals_.apply)
    locked, enter = [], Gate.enter

    def counting_enter(self, depth, value) -> None:
        locked.append(value)
        enter(self, depth, value)

    monkeypatch.setattr(Gate, "enter", counting_enter)

    def run() -> None:
        for _ in range(2000):
            _exit(gate, *_enter(gate, VALUES[0]))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert globals_.applied == 1
    # The first call sets the values; a thread starting meanwhile may see it as a changer.
    assert 1 <= len(locked) <= len(threads), f"{len(locked)} of 8000 steady calls took the lock"


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
