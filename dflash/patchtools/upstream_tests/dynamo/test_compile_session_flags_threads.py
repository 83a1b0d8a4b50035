# Owner(s): ["module: dynamo"]
"""torch.compiler's compile/export session flags are per-thread (#118260).

A compile (or an export) in one thread must not make ``torch.compiler.is_compiling()``
(``is_exporting()``) True in another thread, nor make ``torch.compile`` in another
thread hand back the uncompiled function. Each test holds the compile or export
open with events, so the interleaving is fixed. The module globals that code
outside torch assigns still force the answers in every thread.
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
        """Run ``target`` in a thread; once it sets ``entered``, call ``check`` here,
        then release it."""
        errors = []

        def run():
            try:
                target()
            except Exception as e:  # reported by the test, not lost in the thread
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S), "the other thread never got there")
            check()
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the other thread did not finish")
        self.assertEqual(errors, [])

    def call_in_thread(self, fn):
        out = []
        thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
        thread.start()
        thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the other thread did not finish")
        self.assertEqual(len(out), 1, "the other thread raised")
        return out[0]

    def test_module_flags_assigned_outside_torch_still_force_the_answers(self):
        # Code outside torch saves, sets and restores these module globals; they stay a
        # process-wide force (torch's own sessions set only the calling thread's flag).
        readers = {
            "_is_compiling_flag": torch.compiler.is_compiling,
            "_is_exporting_flag": torch.compiler.is_exporting,
        }
        for name, read in readers.items():
            old = getattr(torch.compiler, name)
            setattr(torch.compiler, name, True)
            try:
                self.assertTrue(read())
                self.assertTrue(self.call_in_thread(read))
            finally:
                setattr(torch.compiler, name, old)
            self.assertFalse(read())

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
