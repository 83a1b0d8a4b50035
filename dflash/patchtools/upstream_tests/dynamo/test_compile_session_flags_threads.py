# Owner(s): ["module: dynamo"]
"""torch.compiler's compile/export session flags are per-thread (#118260).

A compile (or an export) in one thread must not make ``torch.compiler.is_compiling()``
(``is_exporting()``) True in another thread, nor make ``torch.compile`` in another
thread hand back the uncompiled function. Each test holds the compile or export
open with events, so the interleaving is fixed.
"""

import threading

import torch
import torch._dynamo.test_case
from torch._dynamo.test_case import run_tests

TIMEOUT_S = 60


def cos_plus_one(x):
    return x.cos() + 1


def plus_one(x):
    return x + 1


class CompileSessionFlagsThreadTests(torch._dynamo.test_case.TestCase):
    def run_blocked(self, target, entered, release, check):
        """Run ``target`` in a thread; once it sets ``entered``, call ``check`` here, then release it."""
        errors = []

        def run():
            try:
                target()
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S), "the other thread never got there")
            check()
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertEqual(errors, [])

    def test_compile_in_another_thread_is_not_visible(self):
        entered, release = threading.Event(), threading.Event()

        def blocking_backend(gm, example_inputs):
            entered.set()
            release.wait(TIMEOUT_S)
            return gm.forward

        compiled = torch.compile(cos_plus_one, backend=blocking_backend)
        self.run_blocked(
            lambda: compiled(torch.randn(4)),
            entered,
            release,
            lambda: self.assertFalse(torch.compiler.is_compiling()),
        )

    def test_export_in_another_thread_is_not_visible(self):
        entered, release = threading.Event(), threading.Event()

        class Blocking(torch.nn.Module):
            def forward(self, x):
                entered.set()
                release.wait(TIMEOUT_S)
                return x.sin()

        def check():
            self.assertFalse(torch.compiler.is_exporting())
            self.assertIsNot(torch.compile(plus_one, backend="eager"), plus_one)

        self.run_blocked(
            lambda: torch.export.export(Blocking(), (torch.randn(4),), strict=False),
            entered,
            release,
            check,
        )


if __name__ == "__main__":
    run_tests()
