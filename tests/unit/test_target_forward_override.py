"""dflash.target_model.layer_skip: a replacement forward runs in the thread inside ``active`` only, even
for a thread that inherits its context (Python 3.14's thread_inherit_context)."""

import contextvars

import torch
from tiny import in_thread

from dflash.target_model.layer_skip import ForwardOverride


def test_the_replacement_runs_only_in_the_active_thread():
    override = ForwardOverride("test_override")
    module = torch.nn.Identity()
    override.install(module, lambda m, value, own, x: x + value)
    override.install(module, lambda m, value, own, x: x * 100)  # a second install of one override: no-op
    x = torch.ones(2)
    assert torch.equal(module(x), x)
    with override.active(3):
        assert torch.equal(module(x), x + 3)
        inherited = contextvars.copy_context()
        assert torch.equal(in_thread(lambda: inherited.run(module, x)), x)
        assert torch.equal(in_thread(lambda: module(x)), x)
    assert torch.equal(module(x), x) and override.value() is None


def test_two_overrides_on_one_module_compose():
    outer, inner = ForwardOverride("outer"), ForwardOverride("inner")
    module = torch.nn.Identity()
    inner.install(module, lambda m, value, own, x: own(x) + value)
    outer.install(module, lambda m, value, own, x: own(x) * value)
    x = torch.ones(1)
    with inner.active(1), outer.active(10):
        assert torch.equal(module(x), (x + 1) * 10)
    with outer.active(10):
        assert torch.equal(module(x), x * 10)
