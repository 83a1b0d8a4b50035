# Owner(s): ["module: dynamo"]
"""``torch._dynamo.error_on_graph_break`` applies to the calling thread only (#118260).

``torch._dynamo.error_on_graph_break(True)`` entered in one thread must not make
graph breaks raise in another thread's compiles, and one instance entered from
two threads (a function decorated with it) must restore each thread's own value.
The tests hold the regions open with events, so the interleaving is fixed.
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
        self.assertFalse(
            thread.is_alive(), "the thread holding the region did not finish"
        )
        self.assertEqual(out, sin_graph_break_plus_one(x))

    def test_shared_error_on_graph_break_restores_each_threads_value(self):
        # A decorated function enters its one instance from every thread that calls it.
        from torch._dynamo.utils import _get_error_on_graph_break

        allow_graph_breaks = torch._dynamo.error_on_graph_break(False)
        a_inside, b_inside, a_left = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        seen = {}

        @allow_graph_breaks
        def a_region():
            a_inside.set()
            b_inside.wait(TIMEOUT_S)

        @allow_graph_breaks
        def b_region():
            b_inside.set()
            a_left.wait(TIMEOUT_S)

        def a():
            # A enters first and leaves first, while B is still inside.
            a_region()
            seen["a"] = _get_error_on_graph_break()
            a_left.set()

        def b():
            a_inside.wait(TIMEOUT_S)
            with torch._dynamo.error_on_graph_break(True):
                b_region()
                seen["b"] = _get_error_on_graph_break()

        threads = [threading.Thread(target=f, daemon=True) for f in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
            self.assertFalse(
                thread.is_alive(), "a thread entering the shared region did not finish"
            )
        # Each thread is back to the value it had when it entered: A's default, B's
        # outer region's.
        self.assertDictEqual(seen, {"a": False, "b": True})


if __name__ == "__main__":
    run_tests()
