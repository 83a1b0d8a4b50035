# Owner(s): ["module: dynamo"]
"""A compiled call keeps its eval-frame settings while another thread's call ends.

Part of #118260.

For trees whose eval-frame settings (``skip_guard_eval_unsafe``, the
isolate-recompiles id) are C globals shared by all threads: ``compile_wrapper``
saved and restored them around each call, so a call ending in one thread put
back its prior value under a call still running in another.
"""

import threading
import unittest

import torch
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests

TIMEOUT_S = 60
# How long B gets to enter its call while A is inside its own: B either gets in at once
# (nothing holds it) or is held at entry until A has left (the values differ).
B_ENTRY_S = 2


class EvalFrameSettingsThreadTests(torch._dynamo.test_case.TestCase):
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
            # Runs inside the compiled call (at a graph break) and reads the setting in
            # force there.
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

        # A (default settings) is inside its call; B (isolated) starts while A is
        # still inside.
        a = threading.Thread(target=call, args=(plain,), name="a", daemon=True)
        b = threading.Thread(target=call, args=(isolated,), name="b", daemon=True)
        a.start()
        try:
            self.assertTrue(entered["a"].wait(TIMEOUT_S))
            b.start()
            entered["b"].wait(B_ENTRY_S)
            go["a"].set()
            self.assertTrue(entered["b"].wait(TIMEOUT_S))
        finally:
            go["a"].set()
            go["b"].set()
            for thread in (a, b):
                if thread.ident is not None:
                    thread.join(TIMEOUT_S)
                    self.assertFalse(
                        thread.is_alive(), f"thread {thread.name} did not finish"
                    )
        self.assertEqual(errors, [])
        # B read its setting after A's call had ended: it must still be B's own.
        self.assertEqual(seen["b"], isolated._isolate_recompiles_id)


if __name__ == "__main__":
    run_tests()
