"""Higher-order ops in a backward that AOTAutograd traces on a CUDA autograd thread (patch 0003).

AOTAutograd traces the joint graph under ``make_fx`` by calling ``torch.autograd.grad``; for CUDA
tensors (fake ones included) the autograd engine runs the backward nodes on its per-device thread,
carrying the C++ thread-local state (dispatch modes, so ``ProxyTorchDispatchMode`` is active there)
but not Python ``threading.local`` values. ``torch.cond``'s backward (``CondAutogradOp.backward``)
calls ``cond`` again, whose proxy-mode rule calls ``reenter_make_fx``, which reads
``torch.fx.experimental.proxy_tensor._CURRENT_MAKE_FX_TRACER``. That is why the series leaves it a
module global: a per-thread value would be ``None`` on the device thread ("Cannot reenter make_fx
when we're not under a make_fx tracing session"), and flex_attention's backward, which reads it
through ``_maybe_reenter_make_fx``, would silently take its fallback path there. This guards that.

Needs a CUDA device (skipped otherwise). Integration tier: two fresh interpreters.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the CUDA autograd device thread")

SCRIPT = """
import torch


@torch.compile(backend="aot_eager", fullgraph=True)
def f(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


x = torch.randn(8, device="cuda", requires_grad=True)
f(x).sum().backward()
torch.testing.assert_close(x.grad, torch.where(x.sum() > 0, x.cos(), -x.sin()).detach())
print("ok")
"""


def _run(patched: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


@requires_cuda
def test_cond_backward_traced_on_the_cuda_autograd_thread():
    plain = _run(False)
    assert plain.returncode == 0, f"plain torch failed, the scenario is broken: {plain.stderr[-2000:]}"
    patched = _run(True)
    assert patched.returncode == 0, patched.stderr[-3000:]
