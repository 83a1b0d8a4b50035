# Owner(s): ["module: fx"]
"""The FX tracing flag is per-thread (#126024).

While one thread runs ``torch.fx.symbolic_trace``, another thread must not see
``is_fx_symbolic_tracing()`` as True, and its ``torch.compile``d functions must
not raise "Detected that you are using FX to symbolically trace a
dynamo-optimized function". Each test holds a trace open with events, so the
interleaving is fixed, not left to the scheduler.
"""

import threading

import torch
import torch.fx
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.testing._internal.common_utils import run_tests, TestCase

TIMEOUT_S = 60


class BlockingModule(torch.nn.Module):
    """Its forward, run by the tracer, signals ``entered`` and waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.flag_while_tracing = None

    def forward(self, x):
        self.flag_while_tracing = is_fx_symbolic_tracing()
        self.entered.set()
        self.release.wait(TIMEOUT_S)
        return x + 1


def start_trace(module: BlockingModule, errors: list) -> threading.Thread:
    def trace():
        try:
            torch.fx.symbolic_trace(module)
        except Exception as e:  # reported by the test, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=trace, daemon=True)
    thread.start()
    if not module.entered.wait(TIMEOUT_S):
        raise RuntimeError("the tracing thread never reached forward()")
    return thread


def finish_trace(module: BlockingModule, thread: threading.Thread) -> None:
    module.release.set()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        raise AssertionError("the tracing thread did not finish")


def sin_plus_one(x):
    return x.sin() + 1


class TestFxTracingFlagThreads(TestCase):
    def test_flag_is_not_visible_in_another_thread(self):
        module, errors = BlockingModule(), []
        thread = start_trace(module, errors)
        try:
            flag_here = is_fx_symbolic_tracing()
        finally:
            finish_trace(module, thread)
        self.assertEqual(errors, [])
        self.assertTrue(module.flag_while_tracing)
        self.assertFalse(flag_here)

    def test_compiled_call_while_another_thread_traces(self):
        compiled = torch.compile(sin_plus_one, backend="eager")
        x = torch.randn(8)
        compiled(x)
        module, errors = BlockingModule(), []
        thread = start_trace(module, errors)
        try:
            out = compiled(x)
        finally:
            finish_trace(module, thread)
        self.assertEqual(errors, [])
        self.assertEqual(out, sin_plus_one(x))


if __name__ == "__main__":
    run_tests()
