# Owner(s): ["module: fx"]
"""``torch.fx._symbolic_trace._is_fx_tracing_flag`` stays available as a per-thread view.

The FX tracing flag became thread-local (#168999) and the module attribute
``_is_fx_tracing_flag``, which code outside torch reads and writes, went away.
These tests check it reads and writes the calling thread's flag.
"""

import threading

import torch
import torch.fx
import torch.fx._symbolic_trace as symbolic_trace
from torch.testing._internal.common_utils import TestCase, run_tests

TIMEOUT_S = 60


class TestFxTracingFlagLegacyAttribute(TestCase):
    def test_attribute_reads_the_calling_threads_flag(self):
        entered, release = threading.Event(), threading.Event()
        seen = {}

        class Blocking(torch.nn.Module):
            def forward(self, x):
                seen["tracing_thread"] = symbolic_trace._is_fx_tracing_flag
                entered.set()
                release.wait(TIMEOUT_S)
                return x * 2

        thread = threading.Thread(target=torch.fx.symbolic_trace, args=(Blocking(),))
        thread.start()
        try:
            self.assertTrue(entered.wait(TIMEOUT_S))
            seen["other_thread"] = symbolic_trace._is_fx_tracing_flag
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertEqual(seen, {"tracing_thread": True, "other_thread": False})

    def test_attribute_writes_only_the_calling_threads_flag(self):
        is_set, release = threading.Event(), threading.Event()
        seen = {}

        def set_in_worker():
            try:
                symbolic_trace._is_fx_tracing_flag = True
                seen["worker"] = symbolic_trace._is_fx_tracing_flag
            finally:
                is_set.set()
                release.wait(TIMEOUT_S)
                symbolic_trace._is_fx_tracing_flag = False

        thread = threading.Thread(target=set_in_worker)
        thread.start()
        try:
            self.assertTrue(is_set.wait(TIMEOUT_S))
            seen["main"] = symbolic_trace._is_fx_tracing_flag
        finally:
            release.set()
            thread.join(TIMEOUT_S)
        self.assertEqual(seen, {"worker": True, "main": False})


if __name__ == "__main__":
    run_tests()
