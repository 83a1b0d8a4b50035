# Owner(s): ["module: dynamo"]
"""compile_wrapper's per-call state does not leak between threads (#118260).

``torch._dynamo.error_on_graph_break(True)`` entered in one thread must not make
graph breaks raise in another thread's compiles, and a compiled call must run
under its own eval-frame settings while another thread's call with other
settings ends. Each test holds one call open with events, so the interleaving
is fixed.
"""

import threading
import time
import unittest

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
        thread = threading.Thread(target=hold)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            out = compiled(x)
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertEqual(out, sin_graph_break_plus_one(x))

    @unittest.skipUnless(
        hasattr(torch._C._dynamo.eval_frame, "get_eval_frame_isolate_recompiles_id"),
        "needs isolate_recompiles",
    )
    def test_call_keeps_its_isolate_recompiles_id_when_another_call_ends(self):
        get_id = torch._C._dynamo.eval_frame.get_eval_frame_isolate_recompiles_id
        entered = {name: threading.Event() for name in ("a", "b")}
        go = {name: threading.Event() for name in ("a", "b")}
        seen, errors = {}, []

        @torch._dynamo.disable
        def hold():
            # Runs inside the compiled call (at a graph break) and reads the setting in force there.
            name = threading.current_thread().name
            if name in entered:
                entered[name].set()
                go[name].wait(TIMEOUT_S)
                seen[name] = get_id()

        def body(x):
            y = x.sin()
            hold()
            return y + 1

        plain = torch.compile(body, backend="eager")
        isolated = torch.compile(body, backend="eager", isolate_recompiles=True)
        x = torch.randn(4)
        plain(x)
        isolated(x)

        def call(fn):
            try:
                fn(x)
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)

        # A (default settings) is inside its call; B (isolated) starts while A is still inside.
        a = threading.Thread(target=call, args=(plain,), name="a")
        b = threading.Thread(target=call, args=(isolated,), name="b")
        a.start()
        try:
            self.assertTrue(entered["a"].wait(TIMEOUT_S))
            b.start()
            # B is either inside its call already or held at entry until A has left.
            deadline = time.monotonic() + 2
            while not entered["b"].is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            go["a"].set()
            a.join(TIMEOUT_S)
            self.assertTrue(entered["b"].wait(TIMEOUT_S))
        finally:
            go["a"].set()
            go["b"].set()
            a.join(TIMEOUT_S)
            if b.is_alive() or b.ident is not None:
                b.join(TIMEOUT_S)
        self.assertEqual(errors, [])
        # B read its setting after A's call had ended: it must still be B's own.
        self.assertEqual(seen["b"], isolated._isolate_recompiles_id)


if __name__ == "__main__":
    run_tests()
