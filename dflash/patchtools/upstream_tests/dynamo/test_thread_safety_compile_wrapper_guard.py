# Owner(s): ["module: dynamo"]
"""compile_wrapper's per-call state does not leak between threads (#118260).

``torch._dynamo.error_on_graph_break(True)`` entered in one thread must not make
graph breaks raise in another thread's compiles, and compiled calls from several
threads at once must leave the eval-frame settings as they found them.
"""

import threading

import torch
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests

TIMEOUT_S = 60


def sin_graph_break_plus_one(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y + 1


class TestCompileWrapperGuard(torch._dynamo.test_case.TestCase):
    def test_error_on_graph_break_stays_in_its_thread(self):
        entered, release = threading.Event(), threading.Event()

        def hold():
            with torch._dynamo.error_on_graph_break(True):
                entered.set()
                release.wait(TIMEOUT_S)

        compiled = torch.compile(sin_graph_break_plus_one, backend="eager")
        x = torch.randn(8)
        thread = threading.Thread(target=hold)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            out = compiled(x)
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertEqual(out, sin_graph_break_plus_one(x))

    def test_concurrent_compiled_calls_restore_eval_frame_settings(self):
        compiled = torch.compile(sin_graph_break_plus_one, backend="eager")
        x = torch.randn(8)
        compiled(x)
        start = threading.Barrier(4)
        errors = []

        def call_many():
            try:
                start.wait(TIMEOUT_S)
                for _ in range(200):
                    self.assertEqual(compiled(x), sin_graph_break_plus_one(x))
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=call_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        self.assertEqual(errors, [])
        # Every call left: the C-global setting is back to its value outside compiled code.
        self.assertFalse(torch._C._dynamo.eval_frame.set_skip_guard_eval_unsafe(False))


if __name__ == "__main__":
    run_tests()
