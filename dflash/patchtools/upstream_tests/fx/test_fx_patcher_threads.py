# Owner(s): ["module: fx"]
"""FX tracing's monkeypatches are visible only to the tracing thread (#118260).

``Tracer.trace`` patches ``torch.nn.Module.__call__`` (and ``torch.fx.wrap``
functions) while it traces. Another thread's eager module calls must not enter
that tracer, and overlapping traces in two threads must not undo each other's
patches. The lazy-graph-module flags are per thread too: a compile in one thread
(which turns lazy graph modules on) does not change what symbolic_trace returns
in another. Each test holds a trace open with events, so the interleaving is
fixed.
"""

import threading

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.testing._internal.common_utils import run_tests, TestCase

TIMEOUT_S = 60


class BlockingNet(torch.nn.Module):
    """One submodule; forward, run by the tracer, signals ``entered`` and waits for
    ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x):
        y = self.lin(x)
        self.entered.set()
        self.release.wait(TIMEOUT_S)
        return torch.relu(y)


def call_module_targets(gm: torch.fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_module"]


class TestFxPatcherThreads(TestCase):
    def start_trace(
        self, net: BlockingNet, results: dict, key: str
    ) -> threading.Thread:
        def trace():
            try:
                results[key] = call_module_targets(torch.fx.symbolic_trace(net))
            except Exception as e:  # reported by the test, not lost in the thread
                results[key] = e

        thread = threading.Thread(target=trace, daemon=True)
        thread.start()
        self.assertTrue(
            net.entered.wait(TIMEOUT_S), "the tracing thread never reached forward()"
        )
        return thread

    def join(self, thread: threading.Thread) -> None:
        thread.join(TIMEOUT_S)
        self.assertFalse(thread.is_alive(), "the tracing thread did not finish")

    def test_eager_module_call_while_another_thread_traces(self):
        net, eager, results = BlockingNet(), torch.nn.Linear(4, 4), {}
        x = torch.randn(2, 4)
        thread = self.start_trace(net, results, "traced")
        try:
            out = eager(x)
        finally:
            net.release.set()
            self.join(thread)
        self.assertEqual(out, torch.nn.functional.linear(x, eager.weight, eager.bias))
        self.assertEqual(results, {"traced": ["lin"]})

    def test_overlapping_traces_keep_their_own_patches(self):
        first, second, results = BlockingNet(), BlockingNet(), {}
        first_thread = self.start_trace(first, results, "first")
        second_thread = self.start_trace(second, results, "second")
        # The first trace ends (and reverts its patches) while the second is still
        # inside forward.
        first.release.set()
        self.join(first_thread)
        second.release.set()
        self.join(second_thread)
        self.assertEqual(results, {"first": ["lin"], "second": ["lin"]})

    def test_symbolic_trace_during_another_threads_compile_is_not_lazy(self):
        inside, release = threading.Event(), threading.Event()

        def holding_backend(gm, example_inputs):
            inside.set()
            release.wait(TIMEOUT_S)
            return gm.forward

        compiled = torch.compile(lambda x: x + 1, backend=holding_backend)
        thread = threading.Thread(target=compiled, args=(torch.ones(2),), daemon=True)
        thread.start()
        self.assertTrue(
            inside.wait(TIMEOUT_S), "the compiling thread never reached its backend"
        )
        try:
            gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        finally:
            release.set()
            self.join(thread)
        # A _LazyGraphModule is what dynamo makes inside its own compile;
        # torch.jit.script rejects it.
        self.assertNotIsInstance(gm, _LazyGraphModule)
        torch.jit.script(gm)


if __name__ == "__main__":
    run_tests()
