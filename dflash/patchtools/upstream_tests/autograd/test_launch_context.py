# Owner(s): ["module: autograd"]
"""A ContextVar unset in this thread's context reads the launching thread's value on the
autograd threads of a backward traced by make_fx (#118260).

The autograd engine runs a backward's device nodes on its per-device threads, which
carry the launching thread's ATen thread-local state (where ``_engine_run_backward``
stashes its ``contextvars.Context``) but not the context itself. A CPU backward runs on
the launching thread, so the test gives a second thread that stash, as the engine gives
a device thread, from inside the backward while it is in progress.
"""

import contextvars
import threading

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import run_tests, TestCase

FLAG = contextvars.ContextVar("flag")


def read_as_device_thread(context):
    out = []

    def run():
        torch._C._stash_obj_in_tls("context", context)
        try:
            out.append(torch._utils._launch_context_value(FLAG, "unset"))
        finally:
            torch._C._stash_obj_in_tls("context", None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        raise AssertionError("the reading thread did not finish")
    return out[0]


class Probe(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        Probe.seen.append(read_as_device_thread(torch._C._get_obj_in_tls("context")))
        return grad * 2


class TestLaunchContext(TestCase):
    def setUp(self):
        Probe.seen = []

    def test_traced_backward_reads_the_launching_threads_value(self):
        token = FLAG.set("launcher")
        try:
            make_fx(lambda x: torch.autograd.grad(Probe.apply(x).sum(), x)[0])(
                torch.randn(3, requires_grad=True)
            )
        finally:
            FLAG.reset(token)
        self.assertEqual(Probe.seen, ["launcher"])

    def test_eager_backward_reads_nothing_through_it(self):
        token = FLAG.set("launcher")
        try:
            Probe.apply(torch.randn(3, requires_grad=True)).sum().backward()
        finally:
            FLAG.reset(token)
        self.assertEqual(Probe.seen, ["unset"])


if __name__ == "__main__":
    run_tests()
