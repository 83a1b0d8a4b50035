# Owner(s): ["module: dynamo"]
"""``torch._dynamo.error_on_graph_break`` applies to the calling thread only (#118260).

``torch._dynamo.error_on_graph_break(True)`` entered in one thread must not make
graph breaks raise in another thread's compiles. The test holds the region open
with events, so the interleaving is fixed.
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


class CompileWrapperThreadTests(torch._dynamo.test_case.TestCase):
    def test_error_on_graph_break_stays_in_its_thread(self):
        entered, release = threading.Event(), threading.Event()

        def hold():
            with torch._dynamo.error_on_graph_break(True):
                entered.set()
                release.wait(TIMEOUT_S)

        compiled = torch.compile(sin_graph_break_plus_one, backend="eager")
        x = torch.randn(8)
        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            out = compiled(x)
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the thread holding the region did not finish")
        self.assertEqual(out, sin_graph_break_plus_one(x))


if __name__ == "__main__":
    run_tests()
